"""``chunked-entropy bench``: peak memory and time of each approach, each case in a fresh process.

For every shape (tokens, vocabulary, hidden size) and method (plain torch,
the clone workaround, this library's logits path at each chunk size, the fused
head), one forward+backward of ``sum(g_lp * log_prob + g_h * entropy)`` runs in
a fresh process (forked from a server that has imported torch once and never
computed): its peak memory over the inputs and its wall time are measured
there (see :mod:`chunked_entropy.cli._measure`). ``--repeats`` rounds run every
case again, rotating the order of the methods each round so that none always
runs first or last; the table reports medians.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from . import plan
from ._methods import METHODS, Case, methods
from ._process import run_fresh

PRESETS = {
    "issue2": dict(
        path="logits", tokens=[8192], vocab=[32768], dtype="float32",
        methods=["plain", "clone", "chunked"], chunk_sizes=[256, 512, 1024, 2048],
    ),
    "issue3": dict(
        path="head", tokens=[16384, 32768], vocab=[32768], hidden=[512], dtype="float32",
        methods=["plain", "chunked", "head"], chunk_sizes=[512],
    ),
    "loss": dict(
        path="head", tokens=[16384], vocab=[32768], hidden=[512], dtype="float32",
        methods=["headloss", "fusedloss"], chunk_sizes=[512],
    ),
    # verl's objectives, fused, against the fused head + chunked_entropy.losses, on 32 sequences of 512 tokens:
    # token-local ones and a sequence-level one whose sequences fit a chunk (three matmul passes against four);
    # --seq-len 1024 or 16384 (sequences longer than a chunk): each sequence's chunks forward, then back, the last
    # one's logits kept (3 + (g - 1) / g passes for g chunks a sequence, against four)
    "loss-modes": dict(
        path="head", tokens=[16384], vocab=[32768], hidden=[512], dtype="float32",
        methods=["headloss", "fusedloss"], chunk_sizes=[512], loss_modes=["cispo", "sapo", "gspo"], seq_len=512,
    ),
    # on-policy distillation: log-probs + entropy + the teacher's top-128 forward KL and the student's top-128,
    # against the same call without them and verl's route (a full log-softmax) on the same input
    "distill": dict(
        path="logits", tokens=[8192], vocab=[32768], dtype="float32", chunk_sizes=[512],
        methods=["chunked", "distill", "verldistill"], topk=[128], backends=["eager", "compile"],
    ),
    # verl's FSDP engine: its unfused route (prepare_model_outputs on the logits) and its fused torch route
    # (FusedLinearForPPO), each verl's own and with the plugin, against the library's fused head; and the unfused
    # route at TP 2 (gloo), the logits a vocabulary-sharded DTensor (a ColwiseParallel head's): each rank's peak;
    # --topk 128 (the unfused routes) adds verl's top-k distillation
    "verl-fsdp": dict(
        path="head", tokens=[8192], vocab=[32768], hidden=[256], dtype="float32", chunk_sizes=[512], repeats=1,
        methods=["verlfsdp", "fsdpplugin", "verlfused", "fusedplugin", "head"], topk=[0], tp=[1, 2],
    ),
    "loss-logits": dict(
        path="logits", tokens=[8192], vocab=[32768], dtype="float32",
        methods=["chunkedloss", "fusedloss"], chunk_sizes=[512],
    ),
    # with --device cuda: the shape peers publish fused heads at (N=8192, H=4096, V=131072, bf16)
    # the compiled kernels against the eager ones, each with its floor (see cli/_measure.floor_seconds)
    "compile": dict(
        path="logits", tokens=[8192], vocab=[32768], dtype="float32",
        methods=["chunked"], chunk_sizes=[512], backends=["eager", "compile"],
    ),
    "compile-head": dict(
        path="head", tokens=[4096], vocab=[32768], hidden=[512], dtype="float32",
        methods=["head"], chunk_sizes=[512], backends=["eager", "compile"],
    ),
    # every method side by side in one process, the floors measured in the same run: see cli/gpu.py
    "gpu": dict(one_process=True),
    "loss-gpu": dict(
        path="head", tokens=[8192], vocab=[131072], hidden=[4096], dtype="bfloat16",
        methods=["headloss", "fusedloss"], chunk_sizes=[2048],
    ),
    # distillation from the teacher's hidden states (N=8192, H=512, V=32768, float32, the reverse KL): this
    # library's per-token form and loss form against TRL 1.16's ChunkedDivergenceFunction and plain torch
    "divergence": dict(
        path="head", tokens=[8192], vocab=[32768], hidden=[512], dtype="float32", chunk_sizes=[256],
        methods=["divergence", "divergenceloss", "trldivergence", "plaindivergence"],
    ),
    # only the rows that are read (25% and 50% of them labelled): this library's rows="kept" against the same call
    # on all rows, TRL 1.16's compacted call and torch's F.linear_cross_entropy (log-probs only) on the same rows;
    # and log-probs only: the fused head on all rows and with rows="kept" against torch's F.linear_cross_entropy
    # (reduction="none") and plain torch, both on all rows
    "rows": dict(
        path="head", tokens=[16384], vocab=[32768], hidden=[512], dtype="float32", chunk_sizes=[512],
        methods=["head", "headrows", "trlrows", "torchlce", "headlp", "headrowslp", "torchlceall", "plainlp"],
        read=[25, 50],
    ),
    # sampling replay: 64 kept ids per token against none, and the dense-mask route (slime's) on the same input
    "replay": dict(
        dtype="float32", chunk_sizes=[512], keep=[0, 64],
        parts=[
            dict(path="logits", tokens=[8192], vocab=[32768], methods=["chunked", "densekeep"]),
            dict(path="head", tokens=[8192], vocab=[32768], hidden=[512], methods=["head", "densekeep"]),
        ],
    ),
}
DEFAULTS = dict(
    path="logits", tokens=[1024, 2048, 4096, 8192], vocab=[32768], hidden=[512], dtype="float32",
    methods=None, chunk_sizes=[512], repeats=3, backends=["eager"], keep=[0], loss_modes=["vanilla"], tp=[1],
    read=[0],
)
QUICK = dict(
    path="both", tokens=[256, 1024], vocab=[8192], hidden=[256], dtype="float32",
    methods=None, chunk_sizes=[256], repeats=1, backends=["eager"], keep=[0], loss_modes=["vanilla"], tp=[1],
    read=[0],
)


def _counts(text: str) -> list:
    """``"0,64"`` -> ``[0, 64]`` (non-negative integers)."""
    try:
        values = [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


class BenchError(Exception):
    """A user mistake found after parsing (reported in one line, exit code 2)."""


def add_arguments(p, positive_int, int_list, name_list) -> None:
    g = p.add_argument_group("what to measure (a preset or --quick fills what is not given)")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="issue2: logits path, N=8192, V=32768, float32, plain/clone/chunk 256,512,1024,2048; "
                        "issue3: fused head, N=16384,32768, H=512, V=32768, chunk 512, against "
                        "matmul+plain torch and matmul+logits path; loss: the fused policy loss against the fused "
                        "head + losses, N=16384, H=512, V=32768; loss-logits: the same from logits, N=8192; "
                        "loss-gpu (with --device cuda): N=8192, H=4096, V=131072, bf16, chunk 2048; gpu (with "
                        "--device cuda; cpu checks it at a small --tokens/--hidden/--vocab): in one process, the "
                        "floors (the head's GEMMs, a device copy), plain torch, this library's head, fused loss "
                        "and logits path, verl's, Liger's and Apple's kernels, N=8192, H=4096, V=151936 and "
                        "logits N=16384, V=152064, bf16; divergence: "
                        "the reverse KL from a student's and a teacher's hidden states, N=8192, H=512, V=32768, "
                        "against TRL's ChunkedDivergenceFunction and plain torch; rows: 25%% and 50%% of the rows "
                        "read, N=16384, H=512, V=32768, rows='kept' against all rows, TRL's compacted call and "
                        "torch's F.linear_cross_entropy")
    g.add_argument("--quick", action="store_true",
                   help="a small sweep that finishes in under 30 s "
                        "(both paths, N=256,1024, V=8192, H=256, chunk 256, 1 round)")
    g.add_argument("--path", choices=["logits", "head", "both"],
                   help="logits: inputs are [N, V] logits; head: inputs are hidden states [N, H] and an "
                        "lm_head weight [V, H] (plain methods do the matmul first); both (default logits)")
    g.add_argument("--tokens", type=int_list, metavar="N1,N2,...",
                   help="token counts to sweep (default 1024,2048,4096,8192)")
    g.add_argument("--vocab", type=int_list, metavar="V1,...", help="vocabulary sizes to sweep (default 32768)")
    g.add_argument("--hidden", type=int_list, metavar="H1,...",
                   help="hidden sizes for --path head (default 512)")
    g.add_argument("--chunk-sizes", type=int_list, metavar="C1,...",
                   help="chunk_size values for the chunked and fused-head methods (default 512)")
    g.add_argument("--methods", type=name_list, metavar="M1,...",
                   help="subset of plain, clone, chunked, head (log-probs and entropy; the default: all that "
                        "apply to the path), or of chunkedloss, headloss, fusedloss (the policy loss: "
                        "chunked/fused head + chunked_entropy.losses, or the fused policy loss), or of "
                        "divergence, divergenceloss, trldivergence, plaindivergence (--path head: the reverse KL "
                        "between two heads: linear_divergence, its loss form, TRL's function, plain torch)")
    g.add_argument("--read", type=_counts, metavar="P1,...",
                   help="only the rows that are read: the percent of rows whose label is kept (the others -100), "
                        "for head (all rows) and headrows, trlrows, torchlce (the rows read), and the log-prob-only "
                        "headlp, torchlceall, plainlp (all rows) and headrowslp (the rows read); default 0 (every row)")
    g.add_argument("--keep", type=_counts, metavar="K1,...",
                   help="sampling replay: kept ids per token, in vLLM's CSR layout, for this library's methods "
                        "and the dense-mask route densekeep (0: no replay; default 0)")
    g.add_argument("--loss-modes", type=name_list, metavar="L1,...",
                   help="policy objectives of the loss methods, verl's names (vanilla, cispo, sapo, gspo, ...; "
                        "default vanilla)")
    g.add_argument("--seq-len", type=positive_int, metavar="T",
                   help="the loss methods' [B, T] layout: tokens per sequence, dividing every --tokens value "
                        "(default: one sequence of all the tokens)")
    g.add_argument("--topk", type=int_list, metavar="K",
                   help="distillation: the teacher's top-k per token of the methods distill (this library: "
                        "log_probs_at and top_k) and verldistill (verl's forward_kl_topk); default 128 with them")
    g.add_argument("--backends", type=name_list, metavar="B1,...",
                   help="per-block kernels of this library's methods: eager, compile, triton, auto "
                        "(default eager)")
    g.add_argument("--tp", type=int_list, metavar="T1,...",
                   help="tensor-parallel sizes: the vocabulary over that many ranks (gloo processes on CPU) for "
                        f"{', '.join(m.name for m in METHODS.values() if m.tp)} (verl's unfused FSDP routes: the "
                        "logits a vocabulary-sharded "
                        "DTensor); the other methods on one rank (default 1); the peak is the largest rank's, "
                        "each rank's beside it")
    g.add_argument("--dtype", choices=sorted(plan.DTYPE_BYTES), help="dtype of the inputs (default float32)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    g.add_argument("--traffic", action="store_true",
                   help="instead of timing: what each op costs on a GPU, counted on this CPU down the CUDA branch "
                        "(chunked_entropy.testing.measure): kernel launches a call, bytes of elementwise traffic a "
                        "logit, working memory; at the H200 shapes (head and fused loss N=8192, H=4096, "
                        "V=151936; logits path N=16384, V=152064; bf16, chunk 1024) scaled by --traffic-scale "
                        "(block counts kept, bytes scaled back)")
    g.add_argument("--traffic-scale", type=positive_int, default=32, metavar="S",
                   help="with --traffic: run the shapes divided by S (default 32; it must divide them)")
    r = p.add_argument_group("how")
    r.add_argument("--repeats", type=positive_int,
                   help="rounds; every case runs once per round in a fresh process (default 3; 1 with --quick)")
    r.add_argument("--timeout", type=positive_int, default=1800, metavar="SECONDS",
                   help="give up on a case after this long (default 1800)")
    r.add_argument("--warm", action="store_true",
                   help="time a second forward+backward in each case's process (a training loop's later steps: "
                        "kernels loaded, memory reused); the memory columns stay those of the first")
    r.add_argument("--allocations", action="store_true",
                   help="also report alloc_peak_bytes: on CPU the peak of torch's allocations over the inputs, "
                        "from a log of a second, untimed forward+backward (the same on a busy machine)")
    r.add_argument("--force", action="store_true",
                   help="run cases even when the plan's estimate exceeds the memory available")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", default="bench-results",
                   help="directory for results.csv and results.json (default ./bench-results)")
    o.add_argument("--plot", metavar="FILE.png",
                   help="also draw peak memory and time against tokens, one line per method "
                        "(needs matplotlib: pip install 'chunked_entropy[plot]')")


def _settings(args) -> dict:
    base = dict(QUICK if args.quick else DEFAULTS)
    if args.preset:
        base.update(PRESETS[args.preset])
        base.setdefault("repeats", 3)
    for k in ("path", "tokens", "vocab", "hidden", "chunk_sizes", "methods", "dtype", "repeats", "backends", "keep",
              "loss_modes", "topk", "seq_len", "tp", "read"):
        v = getattr(args, k)
        if v is not None:
            base[k] = v
    return base


def build_cases(s: dict, device: str) -> list:
    """The cases of a sweep, grouped by shape; each group lists its methods."""
    paths = ["logits", "head"] if s["path"] == "both" else [s["path"]]
    groups = []
    for path in paths:
        default = [m for m in methods(path) if path in METHODS[m].default]
        chosen = [m for m in (s["methods"] or default) if m in methods(path)]
        if s["methods"] and not chosen:
            continue
        for v in s["vocab"]:
            for h in (s["hidden"] if path == "head" else [0]):
                for n in s["tokens"]:
                    group, seen = [], set()
                    # tensor parallelism: the vocabulary over each --tp size's ranks where the method has it (its
                    # record's tp); the others on one rank, once
                    for tp, name in [(t if METHODS[m].tp else 1, m) for t in s.get("tp") or [1] for m in chosen]:
                        if (tp, name) in seen:
                            continue
                        seen.add((tp, name))
                        m = METHODS[name]
                        # replay: ours at every --keep value, the dense-mask route at the non-zero ones
                        keeps = {"sets": s["keep"], "dense": [k for k in s["keep"] if k]}.get(m.keep, [0])
                        modes = (s.get("loss_modes") or ["vanilla"]) if m.loss else ["vanilla"]
                        # distillation's top-k: the largest --topk, else the record's default
                        topk = 0 if m.topk is None else max(s.get("topk") or [m.topk])
                        seq_len = (s.get("seq_len") or 0) if m.loss else 0
                        reads = (s.get("read") or [0]) if m.read else [0]
                        for c in (s["chunk_sizes"] if m.swept else [0]):
                            for be in (s["backends"] if m.swept else ["eager"]):
                                for kk in keeps:
                                    for lm in modes:
                                        group += [Case(path=path, method=name, tokens=n, vocab=v, hidden=h, chunk=c,
                                                       dtype=s["dtype"], device=device, backend=be,
                                                       warm=bool(s.get("warm")), keep=kk, loss_mode=lm, topk=topk,
                                                       seq_len=seq_len, tp=tp, read=r,
                                                       allocations=bool(s.get("allocations"))) for r in reads]
                    groups.append(group)
    return groups


def plan_bytes(case: Case) -> int:
    """The plan's estimate of the case's peak over its inputs."""
    # one rank's: its vocabulary shard (verl's own unfused route gathers the full vocabulary on every rank)
    spec = case.spec
    shape = plan.Shape(case.tokens, case.vocab, case.hidden, 1 if spec.full_vocab else case.tp, case.dtype)
    # a policy loss needs what its log-probs and entropy need (the fused one: no more)
    method = spec.plan or ("head" if case.path == "head" else "chunked")
    if spec.only_read and case.read:  # the head's on the rows read, the [M, H] gather, the full grad
        return plan.estimate_rows(shape, case.chunk, case.read).total
    e = plan.estimate(method, shape, case.chunk)
    # replay: the kept sets' entries (the ids and one label per token; int64 row and column, two flags, and the
    # sort that orders them); the dense route also holds its [N, V] bool mask and the masked float32 copy
    extra = case.tokens * (case.keep + 1) * 24 if case.keep and spec.keep == "sets" else 0
    if spec.keep == "dense":
        extra = case.tokens * case.vocab * (1 + 4)
    if case.path == "logits":
        return e.over_logits + extra
    e = dataclasses.replace(e, total=e.total + extra)
    # over hidden and weight: the total, and the lm_head's gradients when they come last
    grads = case.hidden * (case.tokens + case.vocab // case.tp) * 4
    return max(e.total, grads) if method != "head" else e.total


def input_bytes(case: Case) -> int:
    """One rank's inputs."""
    b = plan.DTYPE_BYTES[case.dtype]
    if case.path == "logits":
        return case.tokens * case.vocab // case.tp * b
    return (case.tokens + case.vocab // case.tp) * case.hidden * b


def available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


class Progress:
    """A plain-text progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24):
        self.total, self.done, self.width = total, 0, width
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()

    @staticmethod
    def _clock(s: float) -> str:
        s = int(s)
        return f"{s // 60}:{s % 60:02d}"

    def show(self, what: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        fill = int(self.width * self.done / max(self.total, 1))
        bar = "#" * fill + "-" * (self.width - fill)
        line = (f"[{bar}] {self.done}/{self.total} {self._clock(elapsed)} elapsed"
                + (f", ~{self._clock(eta)} left" if eta is not None else "") + f"  {what}")
        if self.tty:
            try:
                width = os.get_terminal_size(2).columns
            except OSError:
                width = 120
            sys.stderr.write("\r\033[K" + line[: width - 1])
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def step(self, what: str) -> None:
        self.done += 1
        self.show(what)

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _describe(case: Case) -> str:
    shape = f"N={case.tokens} V={case.vocab}" + (f" H={case.hidden}" if case.path == "head" else "")
    return f"{case.label} ({shape})"


def run_sweep(groups, repeats: int, timeout: float, force: bool, progress: Progress) -> list:
    """Run every case ``repeats`` times, rotating method order per round; return result rows."""
    runs = {c: [] for g in groups for c in g}
    for r in range(repeats):
        for group in groups:
            k = r % len(group)
            for case in group[k:] + group[:k]:
                progress.show("running " + _describe(case))
                # on CPU every rank is a process of this machine
                need = (plan_bytes(case) + input_bytes(case)) * (case.tp if case.device == "cpu" else 1)
                avail = available_bytes(case.device)
                if not force and need > 0.85 * avail:
                    res = {"status": "skipped",
                           "error": f"needs ~{plan.fmt_bytes(need)}, {plan.fmt_bytes(avail)} available"}
                else:
                    res = run_fresh(case, timeout)
                runs[case].append(res)
                progress.step(_describe(case) + f": {res['status']}")
    progress.close()
    rows = []
    for group in groups:
        plain_time = None
        for case in group:
            rows.append(_summarise(case, runs[case]))
            if case.method == "plain" and rows[-1]["status"] == "ok":
                plain_time = rows[-1]["time_s"]
        for row in rows[-len(group):]:
            if plain_time and row["status"] == "ok" and row["tp"] == 1:  # plain torch runs on one rank
                row["speed_vs_plain"] = plain_time / row["time_s"]
    return rows


def _summarise(case: Case, results: list) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    lb = case.tokens * case.vocab * plan.DTYPE_BYTES[case.dtype]
    row = dataclasses.asdict(case)
    row.update(label=case.label, logits_bytes=lb, plan_bytes=plan_bytes(case), repeats=len(results),
               peak_bytes=None, peak_bytes_ranks=None, alloc_peak_bytes=None, peak_x_logits=None, time_s=None,
               time_min=None, time_max=None,
               cpu_user_s=None, cpu_sys_s=None, speed_vs_plain=None, floor_s=None,
               status="ok" if ok else results[-1]["status"],
               error="" if ok else results[-1].get("error", ""))
    if ok:
        peak = statistics.median(r["peak_bytes"] for r in ok)
        times = [r["time_s"] for r in ok]
        row.update(peak_bytes=int(peak), peak_x_logits=peak / lb, time_s=statistics.median(times),
                   time_min=min(times), time_max=max(times))
        if all("peak_bytes_ranks" in r for r in ok):  # tp > 1: each rank's peak (median over rounds)
            ranks = zip(*(r["peak_bytes_ranks"] for r in ok), strict=True)
            row.update(peak_bytes_ranks=[int(statistics.median(p)) for p in ranks])
        if all("alloc_peak_bytes" in r for r in ok):  # --allocations
            row.update(alloc_peak_bytes=int(statistics.median(r["alloc_peak_bytes"] for r in ok)))
        if all("floor_s" in r for r in ok):
            row.update(floor_s=statistics.median(r["floor_s"] for r in ok))
        if all("cpu_user_s" in r for r in ok):  # not reported over several ranks
            row.update(cpu_user_s=statistics.median(r["cpu_user_s"] for r in ok),
                       cpu_sys_s=statistics.median(r["cpu_sys_s"] for r in ok))
    return row


def markdown_table(rows: list) -> str:
    head_cols = any(r["path"] == "head" for r in rows)
    cols = ["path", "tokens", "vocab"] + (["hidden"] if head_cols else []) + [
        "method", "peak extra memory", "x logits", "plan", "time fwd+bwd (median)", "speed vs plain", "floor",
        "x floor"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if i > 3 else "---" for i in range(len(cols))) + "|"]
    for r in rows:
        if r["status"] == "ok":
            spread = f" ({r['time_min']:.2f}-{r['time_max']:.2f})" if r["repeats"] > 1 else ""
            floor = r.get("floor_s")
            peak = plan.fmt_bytes(r["peak_bytes"])
            if r.get("peak_bytes_ranks"):  # tp > 1: the largest, and each rank's
                peak += " (ranks " + ", ".join(plan.fmt_bytes(p) for p in r["peak_bytes_ranks"]) + ")"
            vals = [peak, f"{r['peak_x_logits']:.3f}", plan.fmt_bytes(r["plan_bytes"]),
                    f"{r['time_s']:.3f} s{spread}",
                    f"{r['speed_vs_plain']:.2f}x" if r["speed_vs_plain"] else "-",
                    f"{floor:.3f} s" if floor else "-", f"{r['time_s'] / floor:.2f}" if floor else "-"]
        else:
            status = f"{r['status']}: {r['error']}".strip(": ")
            vals = [status, "-", plan.fmt_bytes(r["plan_bytes"]), "-", "-", "-", "-"]
        cells = [r["path"], str(r["tokens"]), str(r["vocab"])] + ([str(r["hidden"] or "-")] if head_cols else [])
        lines.append("| " + " | ".join(cells + [r["label"]] + vals) + " |")
    return "\n".join(lines)


def write_results(rows: list, out_dir: str, meta: dict) -> tuple:
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "results.csv")
    json_path = os.path.join(out_dir, "results.json")
    fields = list(rows[0].keys()) if rows else []
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    return csv_path, json_path


def check_plot_available(path: str) -> None:
    """Before any case runs: matplotlib is there, it can write this format, and the folder exists."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'chunked_entropy[plot]'") from None
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise BenchError(f"--plot {path}: expected an image file name ending in one of "
                         f"{', '.join('.' + f for f in sorted(formats))}, e.g. bench.png")
    _check_writable("--plot", path, folder=os.path.dirname(path) or ".")


def _check_writable(flag: str, path: str, *, folder: str) -> None:
    """A clear error now, not after the whole sweep, if ``path`` cannot be written.

    Creates ``folder`` (it will be needed anyway) and writes and removes a probe file in it.
    """
    if flag == "--plot" and os.path.isdir(path):
        raise BenchError(f"{flag} {path}: is a folder; give a file name such as bench.png")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise BenchError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise BenchError(f"--out {out_dir}: exists and is not a folder; give a folder for results.csv and results.json")
    _check_writable("--out", out_dir, folder=out_dir)
    for name in ("results.csv", "results.json"):
        f = os.path.join(out_dir, name)
        if os.path.isdir(f) or (os.path.exists(f) and not os.access(f, os.W_OK)):
            raise BenchError(f"--out {out_dir}: {f} cannot be written")


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ok = [r for r in rows if r["status"] == "ok"]
    multi = len({(r["path"], r["vocab"], r["hidden"]) for r in ok}) > 1
    lines = {}
    for r in ok:
        key = r["label"] + (f" (V={r['vocab']}" + (f", H={r['hidden']}" if r["hidden"] else "") + ")" if multi else "")
        lines.setdefault(key, []).append(r)
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(12, 4.8))
    for key, rs in lines.items():
        rs = sorted(rs, key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rs]
        ax_m.plot(x, [r["peak_bytes"] / 2**20 for r in rs], marker="o", label=key)
        ax_t.plot(x, [r["time_s"] for r in rs], marker="o", label=key)
    for ax, ylabel in ((ax_m, "peak extra memory (MiB)"), (ax_t, "forward+backward time (s, median)")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ticks = sorted({r["tokens"] for r in ok})
        if len(ticks) > 1:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BenchError(f"--device: expected cpu or cuda[:i], got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available here (this torch build or machine has none)")
    if dev.type not in ("cpu", "cuda"):
        raise BenchError(f"--device: expected cpu or cuda[:i], got {device!r}")


def traffic_table(rows: list) -> str:
    """The ``--traffic`` report as a markdown table."""
    lines = ["| op | shape (N x V, H) | launches a call | GEMMs | Triton launches | elementwise B a logit | "
             "working memory |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        shape = f"{r['tokens']} x {r['vocab']}" + (f", {r['hidden']}" if r["hidden"] else "")
        lines.append(f"| {r['op']} | {shape} | {r['launches']:,} | {r['gemms']} | {r['triton_launches']} | "
                     f"{r['bytes_per_logit']:.1f} | {r['working_bytes'] / 2**20:,.0f} MiB |")
    return "\n".join(lines)


def run_traffic(args) -> int:
    """``--traffic``: :func:`chunked_entropy.testing.measure` of every op, a table and ``traffic.json``."""
    from chunked_entropy import testing

    check_out_dir(args.out)
    rows = []
    for op in testing.OPS:
        try:
            rows.append(testing.measure(op, scale=args.traffic_scale))
        except (RuntimeError, ValueError) as e:
            raise BenchError(f"--traffic: {e}") from e
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "traffic.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(traffic_table(rows))
    print()
    print("Counted on the CPU down the CUDA branch (chunked_entropy.testing.cuda_branch): launches are the kernels "
          "one forward+backward dispatches (views and empty allocations launch none; a Triton launch counts one), "
          "elementwise bytes are what every op but the matmuls reads and writes over the [rows, columns] logit "
          "blocks, per logit; working memory is the peak of the call's allocations beyond its results, each "
          f"scaled back to the full shape (shapes divided by {args.traffic_scale}).")
    print(f"Wrote {path}.")
    return 0


def run(args) -> int:
    if getattr(args, "traffic", False):
        return run_traffic(args)
    if args.preset and PRESETS[args.preset].get("one_process"):
        from chunked_entropy.config import BACKENDS

        from . import gpu

        _check_device(args.device)
        check_out_dir(args.out)
        for be in args.backends or []:
            if be not in BACKENDS:
                raise BenchError(f"--backends: unknown backend {be!r}; expected some of {', '.join(BACKENDS)}")
        return gpu.run(args)
    s = _settings(args)
    s["warm"] = args.warm
    s["allocations"] = args.allocations
    _check_device(args.device)
    check_out_dir(args.out)
    if args.plot:
        check_plot_available(args.plot)
    for be in s["backends"]:
        if be not in ("eager", "compile", "triton", "auto"):
            raise BenchError(f"--backends: unknown backend {be!r}; expected some of eager, compile, triton, auto")
    known = sorted(METHODS)
    for m in s["methods"] or []:
        if m not in known:
            raise BenchError(f"--methods: unknown method {m!r}; expected some of {', '.join(known)}")
    from chunked_entropy.losses import LOSS_MODES

    for lm in s.get("loss_modes") or []:
        if lm not in LOSS_MODES:
            raise BenchError(f"--loss-modes: unknown objective {lm!r}; expected some of {', '.join(LOSS_MODES)}")
    if s["path"] == "logits" and s["methods"] and s["methods"] == ["head"]:
        raise BenchError("--methods head needs --path head (the fused head takes hidden states)")
    for name in ("tokens", "vocab", "hidden", "chunk_sizes"):
        if any(x < 1 for x in s[name]):
            raise BenchError(f"--{name.replace('_', '-')}: values must be >= 1")
    if any(t < 1 for t in s["tp"]):
        raise BenchError("--tp: values must be >= 1")
    if any(v % t for v in s["vocab"] for t in s["tp"]):
        raise BenchError(f"--tp: every value must divide every --vocab value ({s['vocab']}), got {s['tp']}")
    if s.get("seq_len") and any(n % s["seq_len"] for n in s["tokens"]):
        raise BenchError(f"--seq-len {s['seq_len']} must divide every --tokens value ({s['tokens']})")
    parts = PRESETS[args.preset].get("parts") if args.preset else None
    groups = [g for part in (parts or [{}]) for g in build_cases({**s, **part}, args.device)]
    if not groups:
        raise BenchError("nothing to measure: --methods selects none of the methods of --path")
    n_cases = sum(len(g) for g in groups)
    progress = Progress(n_cases * s["repeats"], enabled=not args.no_progress)
    print(f"Benchmark: {n_cases} cases x {s['repeats']} rounds, each run in a fresh process on "
          f"{args.device}; peak memory over the inputs and forward+backward time.", file=sys.stderr)
    t0 = time.monotonic()
    rows = run_sweep(groups, s["repeats"], args.timeout, args.force, progress)
    import torch

    meta = {
        "command": "chunked-entropy " + " ".join(getattr(args, "argv", [])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "device": args.device, "repeats": s["repeats"], "seconds": round(time.monotonic() - t0, 1),
    }
    csv_path, json_path = write_results(rows, args.out, meta)
    print(markdown_table(rows))
    print()
    print("peak extra memory: peak over the inputs during one forward+backward, gradients included "
          "(median over rounds; over tp ranks the largest, each rank's in brackets); x logits: that peak / the "
          "[tokens, V] logits' size (the full vocabulary's); plan: the estimate of "
          "`chunked-entropy plan`; speed vs plain: plain torch's median time / this method's.")
    print(f"Wrote {csv_path} and {json_path}.")
    if args.plot:
        dims = sorted({r["dtype"] for r in rows})
        plot(rows, args.plot, f"forward+backward of log-probs and entropy, {', '.join(dims)}, {args.device}, "
                              f"torch {torch.__version__} ({meta['machine']})")
        print(f"Wrote {args.plot}.")
    return 0
