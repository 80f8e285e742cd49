"""Peak memory and time of AReaL's log-probs and entropy: AReaL's own functions against the plugin.

AReaL's ``gather_logprobs_entropy`` (``areal==1.0.4``, installed) and
``chunked_entropy.integrations.areal.gather_logprobs_entropy`` run on the same
input, the way AReaL's engines call them: logits ``[T, V/tp]`` (float32), the
temperature, AReaL's default ``chunk_size`` of 1024, the entropy with its
gradient. At TP 1 AReaL runs its ``torch.compile``d per-chunk function (as
shipped; compiled in a warm-up call of the same shape, not timed); at TP 2 its
vocab-parallel autograd Functions over a gloo group of two processes (rank 0
is measured). One forward+backward of ``sum(g_lp * logprobs + g_h * entropy)``
per case, each case in a fresh interpreter; the peak is the resident memory
over the inputs, measured by ``chunked-entropy bench``'s own ``CpuMemory``.

    python benchmarks/areal_memory.py            # TP 1 and 2, T = 8192, V = 32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunked_entropy.cli._measure import CpuMemory


def _inputs(a, tp, rank):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, a.vocab, (a.tokens,), generator=g)
    ups = torch.randn(2, a.tokens, generator=g)
    v_local = a.vocab // tp
    logits = (torch.randn(a.tokens, v_local, generator=torch.Generator().manual_seed(1 + rank)) * 2).requires_grad_()
    return logits, labels, ups


def _measure(a, method, tp, rank):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "areal":
            from areal.utils.functional import gather_logprobs_entropy as fn
        else:
            from chunked_entropy.integrations.areal import gather_logprobs_entropy as fn
    group = dist.group.WORLD if tp > 1 else None

    def step(logits, labels, ups):
        lp, h = fn(logits, labels, a.temperature, tp_group=group, chunk_size=a.chunk)
        ((lp * ups[0]).sum() + (h * ups[1]).sum()).backward()

    step(*_inputs(a, tp, rank))  # warm-up: AReaL's torch.compile builds here, at this very shape
    logits, labels, ups = _inputs(a, tp, rank)
    memory = CpuMemory()
    memory.reset()
    if tp > 1:
        dist.barrier()
    t0 = time.perf_counter()
    step(logits, labels, ups)
    seconds = time.perf_counter() - t0
    return {"peak_bytes": memory.peak(), "time_s": seconds}


def _rank(rank, a, method, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = _measure(a, method, 2, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _case(method: str, tp: int, a) -> dict:
    if tp == 1:
        return _measure(a, method, 1, 0)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(_rank, args=(a, method, os.path.join(d, "store"), out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--chunk", type=int, default=1024, help="chunk_size of both (default 1024, AReaL's)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--case-tp", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(_case(a.case, a.case_tp, a)), flush=True)
        return 0
    import importlib.metadata

    print(f"areal {importlib.metadata.version('areal')}; T={a.tokens}, V={a.vocab}, float32, temperature "
          f"{a.temperature}, entropy with its gradient, chunk_size {a.chunk}")
    print("| TP | method | peak extra memory (rank 0) | x the logits' gradient | time fwd+bwd (median) |")
    print("|---|---|---:|---:|---:|")
    for tp in a.tp:
        results = {"areal": [], "plugin": []}
        for _ in range(a.repeats):
            for method in results:  # each case a fresh interpreter
                out = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--case", method,
                                      "--case-tp", str(tp)], capture_output=True, text=True, check=True).stdout
                results[method].append(json.loads(out.strip().splitlines()[-1]))
        grad = a.tokens * (a.vocab // tp) * 4
        for method, rows in results.items():
            peak = statistics.median(r["peak_bytes"] for r in rows)
            times = sorted(r["time_s"] for r in rows)
            label = {"areal": "AReaL's own gather_logprobs_entropy", "plugin": "the plugin"}[method]
            print(f"| {tp} | {label} | {peak / 2**30:.2f} GiB | {peak / grad:.3f} | {statistics.median(times):.3f} s "
                  f"({times[0]:.2f}-{times[-1]:.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
