"""examples/grpo_tp.py: TP=2 gradients against the unfused computation, and a real torchrun run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_tp.py"

# Exercises more than the defaults: a strong entropy bonus and KL term (so a
# wrong entropy or KL gradient shows), temperature, several token chunks and
# vocabulary blocks per rank, a loss-aggregation mode other than token-mean.
TEST_CONFIG = dict(
    entropy_coeff=0.5, kl_coef=0.2, temperature=0.8, chunk_size=8, vocab_chunk_size=12,
    loss_agg_mode="seq-mean-token-mean",
)


def load_example():
    """examples/ is not a package: load the script by path (registered, for its dataclasses)."""
    name = "grpo_tp_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # float32 forward/backward of the model against a float64 softmax at the head:
    # relative 1e-5, with an absolute floor at 1e-6 of the tensor's own scale for
    # entries that are (nearly) zero.
    want = want.to(got.dtype)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(scale, 1e-12), msg=lambda m: f"{what}: {m}")


def _tp2_grads_vs_unfused(rank, world, cfg_kwargs, out_path):
    ex = load_example()
    cfg = ex.GRPOConfig(**cfg_kwargs)
    group = dist.group.WORLD
    record = []

    def on_step(step, model, batch, loss, grads):
        assert math.isfinite(loss), f"step {step}: loss {loss}"
        # 1. Same parameters and batch, TP=2, full logits gathered, float64 log_softmax.
        loss_u, _, grads_u = ex.loss_and_grads(model, batch, fused=False)
        assert abs(loss - loss_u) <= 1e-5 * max(1.0, abs(loss_u)), (step, loss, loss_u)
        assert set(grads) == set(grads_u) == {n for n, _ in model.named_parameters()}
        for name, g in grads.items():
            assert torch.isfinite(g).all(), (step, name)
            _close(g, grads_u[name], f"step {step} rank {rank} {name} (fused vs unfused TP=2)")
        # 2. Independently of any collective: one process, TP=1, the whole head weight.
        shards = [torch.empty_like(model.lm_head.weight) for _ in range(world)]
        dist.all_gather(shards, model.lm_head.weight.detach(), group=group)
        single = ex.TinyCausalLM(cfg, None)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        state["lm_head.weight"] = torch.cat(shards)
        single.load_state_dict(state)
        loss_1, _, grads_1 = ex.loss_and_grads(single, batch, fused=False)
        assert abs(loss - loss_1) <= 1e-5 * max(1.0, abs(loss_1)), (step, loss, loss_1)
        v_local = model.lm_head.weight.shape[0]
        for name, g in grads.items():
            want = grads_1[name]
            if name == "lm_head.weight":
                want = want[rank * v_local:(rank + 1) * v_local]
            _close(g, want, f"step {step} rank {rank} {name} (fused TP=2 vs unfused TP=1)")
        record.append(step)

    result = ex.train(2, fused=True, tp_group=group, config=cfg, on_step=on_step)
    assert record == [1, 2]
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": result.losses, "metrics": result.metrics}, f)


LINE = re.compile(
    r"^step (\d+) loss ([-+]\d+\.\d+) entropy (\d+\.\d+) reward (\d+\.\d+) "
    r"clipfrac (\d+\.\d+) ppo_kl ([-+]\d+\.\d+)$"
)


def test_example_tp2_gradients_match_unfused_and_torchrun_runs(tmp_path):
    ex = load_example()
    # The real launcher, started first so that it runs while the spawned check does.
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        # --standalone: the launcher's own store binds port 0 and tells the workers which port it got,
        # so nothing picks a free port and releases it for another process to take first.
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLE), "--steps", "2",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out_path = str(tmp_path / "tp2.json")
        run_distributed(_tp2_grads_vs_unfused, 2, TEST_CONFIG, out_path)
        with open(out_path) as f:
            tp2 = json.load(f)
        # The checked gradients did go through the PPO clip at step 2 (same rollout, moved policy).
        assert tp2["metrics"][0]["pg_clipfrac"] == 0.0 and tp2["metrics"][1]["pg_clipfrac"] > 0.0
        # TP=1 in this process (no process group at all) trains to the same losses.
        tp1 = ex.train(2, config=ex.GRPOConfig(**TEST_CONFIG))
        assert tp1.losses == pytest.approx(tp2["losses"], rel=1e-5, abs=1e-6)

        defaults = ex.train(2)  # what the launched script computes, in one process
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2, stdout  # rank 0 only, one line per step
    assert "TP=2" in stdout, stdout
    for i, ln in enumerate(lines):
        m = LINE.match(ln)
        assert m, ln
        step, loss, entropy, reward, clipfrac, _ = m.groups()
        assert int(step) == i + 1
        assert math.isfinite(float(loss)) and 0.0 < float(entropy) <= math.log(ex.GRPOConfig().vocab_size)
        # printed with 6 decimals; TP=2 and TP=1 agree to float32 rounding
        assert float(loss) == pytest.approx(defaults.losses[i], abs=2e-6)
        assert float(entropy) == pytest.approx(defaults.metrics[i]["entropy"], abs=2e-6)
        assert float(reward) == pytest.approx(defaults.metrics[i]["reward"], abs=1e-4)
        assert float(clipfrac) == pytest.approx(defaults.metrics[i]["pg_clipfrac"], abs=1e-4)



def test_docs_page_runs_and_shows_real_output(monkeypatch):
    text = (ROOT / "docs" / "examples.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1
    monkeypatch.chdir(ROOT)  # the page loads examples/grpo_tp.py relative to the repository root
    exec(compile(blocks[0], "docs/examples.md", "exec"), {"__name__": "__main__"})
    # The sample output on the page is what the default run prints.
    shown = re.search(r"^```text\n(.*?)^```", text, re.S | re.M).group(1).splitlines()
    steps = [LINE.match(ln) for ln in shown if ln.startswith("step ")]
    assert len(steps) == 4 and all(steps)
    ex = load_example()
    run = ex.train(4)
    for i, m in enumerate(steps):
        assert float(m.group(2)) == pytest.approx(run.losses[i], abs=2e-6)
        assert float(m.group(3)) == pytest.approx(run.metrics[i]["entropy"], abs=2e-6)
        assert float(m.group(5)) == pytest.approx(run.metrics[i]["pg_clipfrac"], abs=1e-4)
