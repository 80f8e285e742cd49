"""A/B of one checkout against another on the five bench paths: the time of one forward+backward.

Paired (the method to use): two long-lived worker processes, one per checkout (``PYTHONPATH=<checkout>``,
``torch.set_num_threads(1)`` each, so that they never compete for the cores), each with every path's inputs
built and warmed up once; the parent then asks for one timed sample of a path in A, then the same in B (the
next pair B first, then A), many times, the paths interleaved round by round. Each pair gives one ratio B / A
from two samples taken within a second, so the drift of a busy machine stays out of it; the rounds are split over
``--spawns`` fresh pairs of workers, so that what one process happens to get (allocator state, where its pages
landed: +-8% between single-process runs seen here) is sampled several times on each side. A timed sample is
as many calls in a row as last about ``--sample-ms`` (each worker's count from its warm-up: the logits path's
60-70 ms call four times a sample here), the time per call reported. Per path: the median ratio and
a bootstrap 95% interval of that median (the pairs resampled), with each side's median time per call::

    python benchmarks/ab_api.py --a /path/to/old --b /path/to/new --pairs 60
    python benchmarks/ab_api.py --a /path/to/main --b /path/to/main --pairs 60  # the method's own noise: 1.00

The interval is what "within 3%" is read against: B is within 3% of A on a path when the whole interval lies
in [0.97, 1.03]. Each worker prints the ``chunked_entropy`` it imported (``--a`` / ``--b`` must each hold the
package at its root). It calls 0.2's option objects where the package has them and 0.1's keywords otherwise,
so the same script times both sides of an API change (issue 34: the new surface must cost nothing on the
tuned paths).

Single process (the older method, kept for the recorded table in docs/benchmarks.md): without ``--a``, each
path runs ``--repeats`` times after one warm-up in this process under the package on ``PYTHONPATH``, and a line
per path gives the median and the minimum in milliseconds::

    for i in 1 2 3; do for c in /path/to/old /path/to/new; do
        PYTHONPATH=$c python benchmarks/ab_api.py --label $(basename $c) >> ab.txt; done; done

The shapes are the bench's CPU sizes (``chunked-entropy bench --quick`` and the ``loss`` / ``distill`` /
``divergence`` presets' smallest), small enough for a 2-core machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time

import torch

ce = None  # the package under test: imported by the process that times it (a worker, or the single run)
NEW = False
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


def _import() -> None:
    """Import the package from ``PYTHONPATH`` (this process's checkout)."""
    global ce, NEW
    import chunked_entropy

    ce, NEW = chunked_entropy, hasattr(chunked_entropy, "OutputLayer")


def _timed(run, calls: int = 1) -> float:
    """Seconds per call of ``calls`` calls in a row, the collector run before and kept off during them."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        return (time.perf_counter() - t0) / calls
    finally:
        gc.enable()


def _worker(paths, threads: int, sample_ms: float) -> None:
    """A paired run's worker: every path built and warmed up, then one timed sample per line read (a path's
    name), its seconds per call written back; ``quit`` ends it. A sample is as many calls in a row as last
    about ``sample_ms`` (from the faster of two calls after the warm-up; at least one), so that a short path's sample is
    not one scheduler tick's worth."""
    torch.set_num_threads(threads)
    _import()
    runs = {name: PATHS[name](torch.Generator().manual_seed(0)) for name in paths}
    calls = {}
    for name, run in runs.items():
        run()  # warm-up
        calls[name] = max(1, round(sample_ms / 1e3 / min(_timed(run), _timed(run))))
    print(f"ready {ce.__file__} torch {torch.__version__} threads {torch.get_num_threads()} calls per sample "
          f"{calls}", flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            return
        print(f"{_timed(runs[name], calls[name]):.9f}", flush=True)


class _Worker:
    """A worker process over one checkout (``PYTHONPATH=checkout``), asked one timed call at a time."""

    def __init__(self, checkout: str, paths, threads: int, sample_ms: float):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), OMP_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--paths",
                                      ",".join(paths), "--threads", str(threads), "--sample-ms", str(sample_ms)],
                                     env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=os.path.abspath(checkout))
        self.ready = self.proc.stdout.readline().strip()
        if not self.ready.startswith("ready"):
            raise RuntimeError(f"the worker over {checkout} did not start (exit code {self.proc.wait()})")

    def time(self, path: str) -> float:
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait()


def bootstrap_median(ratios, resamples: int = 4000, seed: int = 0) -> tuple:
    """The 2.5% and 97.5% percentiles of the median of ``ratios`` resampled with replacement."""
    rng = random.Random(seed)
    n = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def paired(a: str, b: str, paths, pairs: int, threads: int, spawns: int = 4, sample_ms: float = 250.0) -> dict:
    """``pairs`` paired rounds of every path, A and B alternating first; per path ``(ratios, times_a, times_b)``.
    The rounds are split over ``spawns`` generations of the two workers, each pair started afresh (the one
    started first alternating), so that what one process happens to get (its allocator's state, where its pages
    landed) is sampled several times on each side instead of once."""
    out = {name: ([], [], []) for name in paths}
    for gen in range(spawns):
        rounds = pairs // spawns + (gen < pairs % spawns)
        first, second = ("A", a), ("B", b)
        workers = dict([first, second] if gen % 2 == 0 else [second, first])
        workers = {side: _Worker(checkout, paths, threads, sample_ms) for side, checkout in workers.items()}
        if gen == 0:
            for side in ("A", "B"):
                print(f"# {side}: {workers[side].ready}", flush=True)
        try:
            for i in range(rounds):
                for name in paths:
                    order = ("A", "B") if i % 2 == 0 else ("B", "A")
                    t = {side: workers[side].time(name) for side in order}
                    ratios, ta, tb = out[name]
                    ratios.append(t["B"] / t["A"])
                    ta.append(t["A"])
                    tb.append(t["B"])
        finally:
            for w in workers.values():
                w.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", help="checkout A (paired mode): the directory holding chunked_entropy/")
    p.add_argument("--b", help="checkout B (paired mode); the ratios are B / A")
    p.add_argument("--pairs", type=int, default=60, help="paired rounds per path (paired mode)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker (paired mode)")
    p.add_argument("--spawns", type=int, default=4, help="fresh worker pairs the rounds are split over (paired mode)")
    p.add_argument("--sample-ms", type=float, default=250.0,
                   help="a sample's length: calls in a row per timed sample (paired mode)")
    p.add_argument("--label", default="this")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path (single-process mode)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    paths = args.paths.split(",")
    unknown = [n for n in paths if n not in PATHS]
    if unknown:
        p.error(f"unknown paths {unknown}; choose from {list(PATHS)}")
    if args.worker:
        return _worker(paths, args.threads, args.sample_ms)
    if (args.a is None) != (args.b is None):
        p.error("--a and --b go together (paired mode)")
    if args.a is not None:
        res = paired(args.a, args.b, paths, args.pairs, args.threads, max(1, min(args.spawns, args.pairs)),
                     args.sample_ms)
        print(f"# {args.pairs} pairs per path over {args.spawns} worker pairs, {args.threads} thread(s) per worker, "
              f"samples of about {args.sample_ms:g} ms; B / A of the time per call: median [95% bootstrap]")
        print("path\tB/A\tlow\thigh\tA_median_ms\tB_median_ms")
        for name, (ratios, ta, tb) in res.items():
            lo, hi = bootstrap_median(ratios)
            print(f"{name}\t{statistics.median(ratios):.4f}\t{lo:.4f}\t{hi:.4f}\t"
                  f"{statistics.median(ta) * 1e3:.2f}\t{statistics.median(tb) * 1e3:.2f}", flush=True)
        return None
    _import()
    torch.set_num_threads(torch.get_num_threads())
    for name in paths:
        run = PATHS[name](torch.Generator().manual_seed(0))
        run()  # warm-up
        times = [_timed(run) for _ in range(args.repeats)]
        print(f"{args.label}\t{name}\tmedian_ms={statistics.median(times) * 1e3:.1f}\tmin_ms={min(times) * 1e3:.1f}",
              flush=True)
    return None


if __name__ == "__main__":
    main()
