"""Peak memory of sampling replay's ``keep=``: what each form of the kept sets adds to the call without it.

One ``log_probs_and_entropy`` call per case under ``torch.no_grad()`` (where
the kept sets' entries are the largest part of the peak), each case in a fresh
interpreter, on float32 logits ``[N, V]`` made before the measurement starts
(the mask and the CSR pair too). The peak is the resident memory over those
inputs, measured with ``chunked-entropy bench``'s own ``CpuMemory``.

Cases: no ``keep``; a dense bool mask all True (what slime's mask builder
leaves for rows without a recorded nucleus), all False, and with ``K`` True
per row; the CSR pair with ``K`` ids per row. ``bytes/kept id`` is the excess
over the call without ``keep``, per kept id (the label's entry included).

    python benchmarks/keep_memory.py                      # N=1024, V=32768, K=64
    python benchmarks/keep_memory.py --tokens 8192 --kept 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from chunked_entropy import log_probs_and_entropy
from chunked_entropy.cli._measure import CpuMemory

CASES = ("none", "dense-all-true", "dense-all-false", "dense-k", "csr-k")


def _one(case: str, n: int, v: int, k: int, chunk: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    keep = None
    if case == "dense-all-true":
        keep = torch.ones(n, v, dtype=torch.bool)
    elif case == "dense-all-false":
        keep = torch.zeros(n, v, dtype=torch.bool)
    elif case == "dense-k":
        keep = torch.zeros(n, v, dtype=torch.bool).scatter_(1, ids, True)
    elif case == "csr-k":
        keep = (ids.reshape(-1), torch.arange(0, n * k + 1, k))
    mem = CpuMemory()
    with torch.no_grad():
        mem.reset()
        log_probs_and_entropy(logits, labels, chunk_size=chunk, keep=keep)
        peak = mem.peak()
    kept = 0 if case in ("none", "dense-all-true", "dense-all-false") else n * (k + 1)
    return {"case": case, "peak_mib": peak / 2**20, "kept_ids": kept}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--kept", type=int, default=64, help="kept ids per row for the dense-k and csr-k cases")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in a child interpreter
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(_one(a.case, a.tokens, a.vocab, a.kept, a.chunk_size)))
        return
    rows = []
    for case in CASES:
        cmd = [sys.executable, __file__, "--case", case, "--tokens", str(a.tokens), "--vocab", str(a.vocab),
               "--kept", str(a.kept), "--chunk-size", str(a.chunk_size)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    base = rows[0]["peak_mib"]
    logits_mib = a.tokens * a.vocab * 4 / 2**20
    print(f"N={a.tokens} V={a.vocab} K={a.kept} chunk={a.chunk_size}, no_grad; float32 logits {logits_mib:.0f} MiB")
    print("| keep | peak | over no keep | bytes/kept id |")
    print("|---|---|---|---|")
    for r in rows:
        extra = r["peak_mib"] - base
        per = f"{extra * 2**20 / r['kept_ids']:.0f}" if r["kept_ids"] else "-"
        print(f"| {r['case']} | {r['peak_mib']:.1f} MiB | {extra:+.1f} MiB | {per} |")


if __name__ == "__main__":
    main()
