"""How much the layout moves the numbers: log-probs and entropy at TP 1, 2 and 4 and several chunk sizes, bits.

    python benchmarks/tp_layout.py [--tokens 2048] [--vocab 32768] [--skip-cost | --cost-only]

Four gloo processes on the CPU. Every rank builds the same float32 logits (``3 * randn``, one row in 16 with a
confident token) and labels; TP 1 is each rank alone, TP 2 the groups {0, 1} and {2, 3}, TP 4 all four. For
each mode (the default, and ``Chunking(invariant=True)``) and (TP, chunk size) it prints, against that mode's
TP 1 at the default chunk size: the largest absolute difference of the log-probs and of the entropy, and the
share of tokens whose bits differ. The same for the fused head (``linear_log_probs_and_entropy``, hidden 256,
the weight sharded by rows) against its own TP 1 default.

Then the invariant mode's cost at TP 1 in this process (one thread, as the ranks): the time of a forward and
backward (log-probs and entropy, random upstream gradients; this process's CPU time, the fastest of
``--reps``, the two modes' runs alternating) of the logits path and
of the fused head (float32, and bf16 weights and hidden states) in each mode, and the peak of the bytes the
call allocates (the allocation log of :class:`chunked_entropy.testing.GpuLog`, ``peak_bytes()``: each
storage an op made, held until it is freed), and their ratios.
docs/exact-tp.md and docs/benchmarks.md quote the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chunked_entropy import Chunking, OutputLayer, linear_log_probs_and_entropy, log_probs_and_entropy  # noqa: E402

CHUNKS = (1, 7, 64, 1024, 4096)
MODES = ("default", "invariant")
HIDDEN = 256


def _data(n, v):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, v, generator=g) * 3
    x[::16, 7] += 30.0
    labels = torch.randint(0, v, (n,), generator=g)
    w = torch.randn(v, HIDDEN, generator=g) / 16
    h = torch.randn(n, HIDDEN, generator=g)
    return x, labels, w, h


def _worker(rank, world, store, n, v, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    x, labels, w, h = _data(n, v)
    rows = []
    for tp in (1, 2, 4):
        group = None if tp == 1 else (dist.group.WORLD if tp == 4 else pairs[rank // 2])
        r = 0 if tp == 1 else dist.get_rank(group)
        vl = v // tp
        cols = slice(r * vl, (r + 1) * vl)
        layer = OutputLayer(process_group=group)
        head = OutputLayer(w[cols].contiguous(), process_group=group)
        with torch.no_grad():
            for mode in MODES:
                for chunk in CHUNKS:
                    c = Chunking(chunk, invariant=mode == "invariant")
                    o = log_probs_and_entropy(x[:, cols], labels, layer=layer, chunking=c)
                    f = linear_log_probs_and_entropy(h, head, labels, chunking=c)
                    rows.append((mode, tp, chunk, o.log_probs, o.entropy, f.log_probs, f.entropy))
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def _stats(a, b):
    return (a.double() - b.double()).abs().max().item(), (a != b).double().mean().item()


PATHS = {"logits": "logits path", "head": "fused head (H = 256)", "head-bf16": "fused head, bf16 (H = 256)"}


def _step(fn, x, labels, h, w, chunking, g):
    """One forward and backward: ``fn`` one of :data:`PATHS`; returns nothing (the gradients are dropped)."""
    if fn == "logits":
        xl = x.detach().requires_grad_()
        o = log_probs_and_entropy(xl, labels, chunking=chunking)
    else:
        if fn == "head-bf16":
            h, w = h.bfloat16(), w.bfloat16()
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        o = linear_log_probs_and_entropy(hh, OutputLayer(ww), labels, chunking=chunking)
    (o.log_probs * g[0] + o.entropy * g[1]).sum().backward()


def _cost(n, v, reps):
    """``[(path, mode, fastest seconds, peak bytes)]`` at TP 1 in this process, one thread, in CPU time (this
    process's: the work, not the machine's other load). The two modes' runs alternate (default, invariant,
    default, ...) and each mode's fastest of ``reps`` is taken: on a shared machine the remaining disturbance
    (caches, memory bandwidth) then falls on both alike, and the fastest run is the one it disturbed least."""
    from chunked_entropy.testing import GpuLog

    torch.set_num_threads(1)
    x, labels, w, h = _data(n, v)
    g = torch.randn(2, n, generator=torch.Generator().manual_seed(1))
    out = []
    for fn in PATHS:
        chunking = {mode: Chunking(1024, invariant=mode == "invariant") for mode in MODES}
        times = {mode: [] for mode in MODES}
        for mode in MODES:
            _step(fn, x, labels, h, w, chunking[mode], g)  # warm
        for _ in range(reps):
            for mode in MODES:
                t0 = time.process_time()
                _step(fn, x, labels, h, w, chunking[mode], g)
                times[mode].append(time.process_time() - t0)
        for mode in MODES:
            with GpuLog() as log:
                _step(fn, x, labels, h, w, chunking[mode], g)
            out.append((fn, mode, min(times[mode]), log.peak_bytes()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-cost", action="store_true", help="the bits only, not the invariant mode's cost")
    ap.add_argument("--cost-only", action="store_true", help="the invariant mode's cost only, not the bits")
    a = ap.parse_args()
    if not a.cost_only:
        _bits(a)
    if not a.skip_cost:
        _print_cost(a)


def _bits(a):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(_worker, args=(4, os.path.join(d, "store"), a.tokens, a.vocab, out), nprocs=4)
        rows = torch.load(out)
    print(f"{a.tokens} tokens, V = {a.vocab}, float32, torch {torch.__version__}, gloo; against the mode's TP 1, "
          "chunk 1024\n")
    print("| mode | TP | chunk | log-probs: max abs diff | tokens with other bits | entropy: max abs diff | tokens "
          "with other bits | fused head log-probs: max abs diff | other bits | fused entropy: max abs diff | other "
          "bits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, tp, chunk, lp, ent, flp, fent in rows:
        base = next(r for r in rows if r[0] == mode and r[1] == 1 and r[2] == 1024)
        cells = [_stats(lp, base[3]), _stats(ent, base[4]), _stats(flp, base[5]), _stats(fent, base[6])]
        print(f"| {mode} | {tp} | {chunk} | " + " | ".join(f"{m:.2g} | {share:.1%}" for m, share in cells) + " |")


def _print_cost(a):
    cost = _cost(a.tokens, a.vocab, a.reps)
    print("\nThe invariant mode's cost at TP 1 (one thread, CPU time, forward + backward of log-probs and entropy, "
          f"chunk 1024, the fastest of {a.reps}, the modes alternating; peak: the bytes the call allocates, from an "
          "allocation log)\n")
    print("| path | default: time | invariant: time | ratio | default: peak | invariant: peak | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fn, name in PATHS.items():
        d, i = (next(r for r in cost if r[0] == fn and r[1] == m) for m in MODES)
        print(f"| {name} | {d[2] * 1e3:.0f} ms | "
              f"{i[2] * 1e3:.0f} ms | {i[2] / d[2]:.2f}x | {d[3] / 2**20:.1f} MiB | {i[3] / 2**20:.1f} MiB | "
              f"{i[3] / d[3]:.2f}x |")


if __name__ == "__main__":
    main()
