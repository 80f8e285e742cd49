"""Every ```python block in the README, the getting-started, concepts, losses, Hugging Face and verl pages runs.

Each block runs on its own, in a fresh namespace, as a reader would paste it.
A block with a file name (```python title="tp_example.py"```) is written to
that file and run with the command the page gives for it
(``torchrun --nproc-per-node 2 tp_example.py``), or with plain ``python``
when the page gives none.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md", "docs/getting-started.md", "docs/concepts.md", "docs/integrations/huggingface.md",
    "docs/integrations/verl.md", "docs/losses.md", "docs/distillation.md",
]

_FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)
_TITLE = re.compile(r'title="([^"]+)"')


def _blocks(page: str):
    text = (ROOT / page).read_text()
    for m in _FENCE.finditer(text):
        title = _TITLE.search(m.group(1))
        line = text.count("\n", 0, m.start()) + 1
        yield pytest.param(page, text, title.group(1) if title else None, m.group(2), id=f"{page}:{line}")


def _all_blocks():
    return [p for page in PAGES for p in _blocks(page)]


def test_pages_have_examples():
    # The extraction itself must find the examples (a changed fence style would
    # otherwise silently test nothing).
    for page in PAGES:
        assert len(list(_blocks(page))) >= 1, page


@pytest.mark.parametrize("page,text,title,code", _all_blocks())
def test_example_runs(page, text, title, code, tmp_path, monkeypatch):
    if title is None:
        monkeypatch.chdir(tmp_path)
        exec(compile(code, f"{page} example", "exec"), {"__name__": "__main__"})
        return
    script = tmp_path / title
    script.write_text(code)
    cmd = re.search(rf"^(torchrun [^\n]*\b{re.escape(title)}\b[^\n]*)$", text, re.M)
    if cmd:
        argv = shlex.split(cmd.group(1))
        # --standalone: a free rendezvous port, so parallel test runs cannot collide.
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"] + argv[1:]
    else:
        argv = [sys.executable, title]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"

