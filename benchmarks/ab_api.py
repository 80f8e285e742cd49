"""A/B of one checkout against another on the five bench paths: the time of one forward+backward.

Run it under each checkout's package (``PYTHONPATH=<checkout>``), alternating, and compare the medians; it calls
0.2's option objects where the package has them and 0.1's keywords otherwise, so the same script times both
sides of an API change (issue 34: the new surface must cost nothing on the tuned paths)::

    for i in 1 2 3; do for c in /path/to/old /path/to/new; do
        PYTHONPATH=$c python benchmarks/ab_api.py --label $(basename $c) >> ab.txt; done; done

Each path runs ``--repeats`` times after one warm-up in this process; a line per path gives the median and the
minimum in milliseconds. The shapes are the bench's CPU sizes (``chunked-entropy bench --quick`` and the
``loss`` / ``distill`` / ``divergence`` presets' smallest), small enough for a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import chunked_entropy as ce

NEW = hasattr(ce, "OutputLayer")
N, V, H, C = 1024, 8192, 256, 256


def _logits(g):
    x = torch.randn(N, V, generator=g).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)

    def run():
        out = ce.log_probs_and_entropy(x, y, chunking=C) if NEW else ce.log_probs_and_entropy(x, y, chunk_size=C)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    return run


def _head_inputs(g):
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    return h, w, torch.randint(0, V, (N,), generator=g)


def _head(g):
    h, w, y = _head_inputs(g)

    def run():
        out = (ce.linear_log_probs_and_entropy(h, w, y, chunking=C) if NEW
               else ce.linear_log_probs_and_entropy(h, w, y, chunk_size=C))
        (out.log_probs.sum() + out.entropy.sum()).backward()
    return run


def _loss(g):
    h, w, y = _head_inputs(g)
    b, t = 4, N // 4
    h3, y2 = h.detach().view(b, t, H).requires_grad_(), y.view(b, t)
    old, adv, mask = -torch.rand(b, t, generator=g), torch.randn(b, t, generator=g), torch.ones(b, t, dtype=torch.bool)

    def run():
        if NEW:
            loss, _ = ce.linear_policy_loss(h3, w, y2, old, adv, mask, loss=ce.PolicyLoss(entropy_coeff=0.01),
                                            chunking=C)
        else:
            loss, _ = ce.linear_policy_loss(h3, w, y2, old, adv, mask, entropy_coeff=0.01, chunk_size=C)
        loss.backward()
    return run


def _distill(g):
    h, w, _ = _head_inputs(g)
    ids = torch.randint(0, V, (N, 128), generator=g)

    def run():
        out = (ce.linear_log_probs_and_entropy(h, w, None, chunking=C, log_probs_at=ids) if NEW
               else ce.linear_log_probs_and_entropy(h, w, None, chunk_size=C, log_probs_at=ids))
        out.log_probs_at.sum().backward()
    return run


def _divergence(g):
    h, w, _ = _head_inputs(g)
    ht, wt = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.05

    def run():
        if NEW:
            out = ce.linear_divergence(h, w, ht, wt, divergence="reverse_kl", chunking=C)
        else:
            out = ce.linear_divergence(h, w, ht, wt, divergence="reverse_kl", chunk_size=C)
        out.divergence.sum().backward()
    return run


PATHS = {"logits": _logits, "head": _head, "loss": _loss, "distill": _distill, "divergence": _divergence}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="this")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--paths", default=",".join(PATHS))
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    for name in args.paths.split(","):
        run = PATHS[name](torch.Generator().manual_seed(0))
        run()  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        print(f"{args.label}\t{name}\tmedian_ms={statistics.median(times) * 1e3:.1f}\tmin_ms={min(times) * 1e3:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
