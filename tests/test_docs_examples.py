"""Every ```python block of README.md and docs/**/*.md runs, on the 0.2 API.

Each block runs on its own, in a fresh namespace, as a reader would paste it.
A block with a file name (```python title="tp_example.py"```) is written to
that file and run with the command the page gives for it
(``torchrun --nproc-per-node 2 tp_example.py``), or with plain ``python``
when the page gives none.

A block that cannot run here (a fragment of a Megatron or framework launch,
a GPU) says so in its first lines with ``# doc-example: no-run (why)``; it is
still found and must still parse. Every other block runs with 0.1's flat
keywords as an error: the documentation shows the current calls.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))

_FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)
_TITLE = re.compile(r'title="([^"]+)"')
#: The marker of a block that cannot run on a CPU in the suite, with its reason after it.
NO_RUN = re.compile(r"^# doc-example: no-run \(.{10,}$", re.M)
#: What 0.1's keywords warn (chunked_entropy._migrate).
OLD_KEYWORDS = r".*are 0\.1's"


def _logit_blocks(page: str):
    text = (ROOT / page).read_text()
    for m in _FENCE.finditer(text):
        title = _TITLE.search(m.group(1))
        line = text.count("\n", 0, m.start()) + 1
        yield pytest.param(page, text, title.group(1) if title else None, m.group(2), id=f"{page}:{line}")


def _all_blocks():
    return [p for page in PAGES for p in _logit_blocks(page)]


def test_pages_have_examples():
    # The extraction itself must find the examples (a changed fence style would
    # otherwise silently test nothing).
    for page in ("README.md", "docs/getting-started.md", "docs/concepts.md", "docs/api.md", "docs/losses.md",
                 "docs/distillation.md", "docs/examples.md", "docs/integrations/huggingface.md",
                 "docs/integrations/megatron.md", "docs/integrations/verl.md"):
        assert len(list(_logit_blocks(page))) >= 1, page
    assert sum(1 for *_, code in (p.values for p in _all_blocks()) if not NO_RUN.search(code)) >= 25


def test_the_no_run_marker_is_recognised():
    assert NO_RUN.search("import x\n# doc-example: no-run (needs a megatron-core model)\n")
    assert not NO_RUN.search("# doc-example: no-run\n")  # a reason is required
    assert not NO_RUN.search("x = 1  # doc-example: no-run (not at the start of a line)\n")


@pytest.mark.parametrize("page,text,title,code", _all_blocks())
def test_example_runs(page, text, title, code, tmp_path, monkeypatch):
    if NO_RUN.search(code):
        ast.parse(code)  # still Python
        pytest.skip(NO_RUN.search(code).group(0))
    if title is None:
        # docs/examples.md loads examples/ by a path relative to the repository
        monkeypatch.chdir(ROOT if "examples/" in code else tmp_path)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=OLD_KEYWORDS, category=DeprecationWarning)
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
    # a DeprecationWarning attributed to the script (__main__) is shown: 0.1's keywords would be on stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="always::DeprecationWarning")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert not re.search(OLD_KEYWORDS, proc.stderr), proc.stderr


@pytest.mark.parametrize("module", ["chunked_entropy.options", "chunked_entropy.head", "chunked_entropy.config",
                                    "chunked_entropy.testing"])
def test_docstring_examples_run(module):
    """The ``>>>`` examples of the option objects', the head's, the config's and the testing tools' docstrings
    run and print what they show."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
