"""How much the layout moves the numbers: log-probs and entropy at TP 1, 2 and 4 and several chunk sizes, bits.

    python benchmarks/tp_layout.py [--tokens 2048] [--vocab 32768]

Four gloo processes on the CPU. Every rank builds the same float32 logits (``3 * randn``, one row in 16 with a
confident token) and labels; TP 1 is each rank alone, TP 2 the groups {0, 1} and {2, 3}, TP 4 all four. For
each (TP, chunk size) it prints, against TP 1 at the default chunk size: the largest absolute difference of the
log-probs and of the entropy, and the share of tokens whose bits differ. The same for the fused head
(``linear_log_probs_and_entropy``, hidden 256, the weight sharded by rows) against its own TP 1 default.
docs/exact-tp.md quotes the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chunked_entropy import OutputLayer, linear_log_probs_and_entropy, log_probs_and_entropy  # noqa: E402

CHUNKS = (1, 7, 64, 1024, 4096)
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
            for chunk in CHUNKS:
                o = log_probs_and_entropy(x[:, cols], labels, layer=layer, chunking=chunk)
                f = linear_log_probs_and_entropy(h, head, labels, chunking=chunk)
                rows.append((tp, chunk, o.log_probs, o.entropy, f.log_probs, f.entropy))
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def _stats(a, b):
    return (a.double() - b.double()).abs().max().item(), (a != b).double().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(_worker, args=(4, os.path.join(d, "store"), a.tokens, a.vocab, out), nprocs=4)
        rows = torch.load(out)
    base = next(r for r in rows if r[0] == 1 and r[1] == 1024)
    print(f"{a.tokens} tokens, V = {a.vocab}, float32, torch {torch.__version__}, gloo; against TP 1, chunk 1024\n")
    print("| TP | chunk | log-probs: max abs diff | tokens with other bits | entropy: max abs diff | tokens with "
          "other bits | fused head log-probs: max abs diff | other bits | fused entropy: max abs diff | other bits |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tp, chunk, lp, ent, flp, fent in rows:
        cells = [_stats(lp, base[2]), _stats(ent, base[3]), _stats(flp, base[4]), _stats(fent, base[5])]
        print(f"| {tp} | {chunk} | " + " | ".join(f"{m:.2g} | {share:.1%}" for m, share in cells) + " |")


if __name__ == "__main__":
    main()
