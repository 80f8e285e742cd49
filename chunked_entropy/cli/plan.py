"""``chunked-entropy plan``: the memory each approach needs, and the chunk_size to use.

The estimates are the peak memory of one forward+backward of the loss head
(log-probs and entropy, both with gradients), per tensor-parallel rank, in
bytes, derived from what each approach allocates. Notation:

* ``N`` tokens, ``V`` = vocabulary / tp (this rank's shard), ``H`` hidden size,
  ``c`` = min(chunk_size, N), ``B`` = bytes per element of the logits' (or the
  hidden states' and weight's) dtype: 4 for float32, 2 for bfloat16/float16;
* ``L = N*V*4``: the logits in float32; ``Lb = N*V*B``: the logits in their dtype;
* ``C = c*V*4``: one float32 chunk buffer; ``Wg = V*H*4``: the float32
  weight-gradient accumulator; ``Hg = N*H*B``: the hidden states' gradient.

Two figures per approach:

``over logits``
    the peak over given logits (they exist already; ``bench --path logits``
    measures this):

    - plain torch (``log_softmax``, ``gather``, ``-(p*logp).sum()``): ``5L``.
      Autograd keeps ``logp`` and ``p`` (float32) for backward; at the peak
      of backward they coexist with the product's two gradients (for ``p``
      and for ``logp``) and the output of ``exp``'s backward.
    - clone workaround: ``3L`` (+ ``Lb`` when ``B != 4``): the entropy's saved
      softmax, the clone (which becomes the cross-entropy's softmax, then its
      gradient) and the entropy's gradient; for half-precision logits the
      clone is a separate half copy and the in-place cross-entropy works on a
      float32 copy of it.
    - this library's logits path: ``max(2C, Lb + C)`` (+ ``C`` in backward
      when ``B != 4``): forward holds two float32 chunk buffers; backward
      holds the gradient (the logits' shape and dtype), one float32 scratch
      chunk, and for half-precision logits a float32 working chunk (for
      float32 the gradient's own rows are the working buffer).

``total``
    the peak when the lm_head matmul runs inside the step, counted over the
    hidden states and the weight (``bench --path head`` measures this): it
    adds the logits themselves, ``Lb``, for approaches that keep them for
    backward (clone workaround, logits path); plain torch frees them once
    ``log_softmax`` has its output, so its total stays ``5L``. The lm_head's own
    gradients (``Hg + Wg``) come after the peak for these approaches.

    - fused head, float32: ``2C + Wg + Hg + c*H*4`` (+ ``V*4`` with a bias):
      two float32 chunk buffers, the weight gradient (accumulated in
      place), the hidden states' gradient and its per-chunk float32
      accumulator. ``C`` uses the forward's vocabulary block: the whole
      shard while ``C`` is at most 128 MiB, else the widest multiple of 128
      columns that keeps it there.
    - fused head, bf16/fp16: the backward walks vocabulary blocks of
      ``Vg`` columns outermost, ``Vg`` the widest multiple of 128 whose
      ``[N, Vg]`` gradient buffer in the weight's dtype fits 64 MiB (4096
      at 8192 bf16 tokens), no wider than ``Vf``; ``Wg' = V*H*B`` is the
      weight gradient in its own dtype (no float32 ``[V, H]``
      accumulator). On CUDA (``backend="auto"``: the Triton kernels),
      without a bias: forward ``c*Vf*B``, one block buffer in the weight's
      dtype, which the matmul writes and the kernels read; backward ``Wg'
      + Hg + N*Vg*B + N*H*4``: each block filled for all tokens into the
      ``[N, Vg]`` buffer and overwritten there by its gradient, which the
      weight gradient's matmul reads, and the hidden states' float32
      accumulator, to which each block's ``g @ W`` is added inside the
      matmul (together 192 MiB at 8192 tokens, H = 4096, V = 151936, chunk
      1024: what ``bench --traffic`` measures from the allocations; a torch
      whose ``addmm`` cannot add half-precision products into a float32
      accumulator, before 2.8, forms the block's float32 ``[N, H]``
      product first: ``N*H*4`` more). With a
      bias, float32 blocks: forward ``c*Vf*4 + c*Vf*B`` (the matmul's
      output widened), backward ``Wg' + Hg + c*Vg*4 + c*Vg*B + N*Vg*B +
      N*H*4`` (chunks of ``c`` rows; ``c*H*4`` more without that
      ``addmm``). On a CPU (``--device cpu``,
      the eager kernels): forward ``2C + c*Vf*B``; backward ``Wg' + Hg +
      2*c*Vg*4 + N*H*4 + N*Vg*B + c*Vg*B + c*H*4 + Vg*H*4 + c*Vg*4``, the
      last two float32 copies of the half-precision operands (a CPU has no
      half-precision matmul into float32). No ``[N, V]`` tensor ever
      exists.

    - fused loss (``linear_policy_loss``), two walks (``Chunking.max_working_bytes``
      chooses, :func:`chunked_entropy.config.three_pass_bytes`):

      * 3 GEMM passes (logits, ``g @ W``, ``g.T @ h``; each chunk's logits
        over the whole shard): working memory ``2*c*V*4 + c*V*B + c*H*(4+B)``
        plus, for bf16/fp16, the float32 weight-gradient accumulator
        ``V*H*4`` and the weight-gradient matmul's float32 result (CUDA: row
        slices of at most 64 MiB; CPU: ``c*H*4``); total that plus ``Hg``,
        or the accumulator beside the weight gradient in its dtype
        (``V*H*B``) when backward rounds it, whichever is larger. Float32
        weights sum into their own gradient (``Wg``, counted as a gradient).
      * 4 GEMM passes: a statistics pass, then the fused head's backward
        walk: the fused head's figures.

      A call takes three passes where that working memory fits the budget
      (default 1 GiB) and ``vocab_chunk_size`` is not set below the shard
      (with ``main_grad`` the accumulator is the float32 gradient the call
      keeps anyway: not counted there).

The vocabulary blocks ``Vf`` and ``Vg`` are the ones a call takes: :func:`blocks` asks
:func:`chunked_entropy.config.walk_plan`, the function every op sizes its walk with.

Not counted: a few float32 and int64 vectors per token (tens of bytes per
token), and what the matmul library keeps for the life of the process (about
10 MiB with MKL on CPU). ``tests/test_cli.py`` holds these formulas within 15%
of what ``bench`` measures; ``tests/test_gpu_path.py`` holds the fused head's
CUDA figure within 10% of the working memory measured from the allocations
of a call down the CUDA branch (:func:`chunked_entropy.testing.measure`).

The recommended ``chunk_size`` is the largest candidate (at most 1024, beyond
which speed no longer improves) whose chunk buffers stay within 1/8 of the
logits (``2C <= Lb / 8``; the smallest candidate if none does) and whose total
fits the memory budget; the logits path is recommended when it fits, else the
fused head, which never holds the logits.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

import torch

from chunked_entropy import Chunking
from chunked_entropy.config import WORKING_BYTES, three_pass_bytes, walk_plan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 2**20
GiB = 2**30
DEFAULT_CHUNKS = (64, 128, 256, 512, 1024, 2048)
MAX_RECOMMENDED_CHUNK = 1024


@dataclass(frozen=True)
class Shape:
    """What the estimates depend on; ``vocab`` is the global vocabulary."""

    tokens: int
    vocab: int
    hidden: int = 0
    tp: int = 1
    dtype: str = "float32"
    bias: bool = False
    device: str = "cuda"  # "cpu": no half-precision matmul into float32 there (see the fused head's formula)

    @property
    def v_local(self) -> int:
        return -(-self.vocab // self.tp)

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def logits_bytes(self) -> int:
        """``Lb``: this rank's logits in their dtype."""
        return self.tokens * self.v_local * self.b


@dataclass(frozen=True)
class Estimate:
    approach: str  # "plain", "clone", "chunked", "head", "loss3", "loss4" (the fused loss's two walks)
    chunk: int  # 0 where there is none
    over_logits: Optional[int]  # None for the fused head: it has no logits input
    total: int
    working: Optional[int] = None  # the fused head's peak beyond its inputs and their gradients
    read: int = 0  # the fused head with rows="kept": the percent of the rows read (0: all of them)

    @property
    def label(self) -> str:
        return {
            "plain": "plain torch",
            "clone": "clone workaround",
            "chunked": f"chunked logits path, chunk {self.chunk}",
            "head": f"fused head, chunk {self.chunk}" + (f", rows='kept' ({self.read}% read)" if self.read else ""),
            "loss3": f"fused loss, chunk {self.chunk}, 3 GEMM passes",
            "loss4": f"fused loss, chunk {self.chunk}, 4 GEMM passes",
        }[self.approach]


def blocks(shape: Shape, chunk: int) -> tuple:
    """``(Vf, Vg)``: the forward's and the backward's vocabulary blocks of the fused head at ``chunk``, as a
    call sizes them (:func:`chunked_entropy.config.walk_plan`, the function every op takes its plan from), with
    the weight's gradient wanted; ``Vg`` is None where the backward walks chunks outermost (float32). A
    ``chunk`` of 0 (a method without chunks) sizes the blocks as one row a chunk would."""
    plan = walk_plan(Chunking(max(chunk, 1)), tokens=shape.tokens, width=shape.v_local,
                     dtype=getattr(torch, shape.dtype), device=torch.device(shape.device), bias=shape.bias,
                     weight_grad=True, kernels=False)
    return plan.vocab_chunk_size, plan.grad_vocab_chunk_size


def estimate(approach: str, shape: Shape, chunk: int = 0) -> Estimate:
    """Peak memory of one forward+backward of ``approach`` (see the module docstring)."""
    n, v, h, b = shape.tokens, shape.v_local, shape.hidden, shape.b
    big_l = n * v * 4
    lb = shape.logits_bytes
    c = min(chunk, n) if chunk else 0
    big_c = c * v * 4
    half = b != 4
    if approach == "plain":
        return Estimate("plain", 0, 5 * big_l, 5 * big_l)
    if approach == "clone":
        over = 3 * big_l + (lb if half else 0)
        return Estimate("clone", 0, over, over + lb)
    if approach == "chunked":
        over = max(2 * big_c, lb + big_c + (big_c if half else 0))
        return Estimate("chunked", chunk, over, over + lb)
    if approach == "head":
        vf, vg = blocks(shape, chunk)  # the forward's vocabulary block, and the backward's (walked outermost)
        fwd = 2 * c * vf * 4 + (c * vf * b if half else 0)
        if not half:
            grads = v * h * 4 + n * h * b + (v * 4 if shape.bias else 0)
            bwd = grads + 2 * c * vf * 4 + c * h * 4
            return Estimate("head", chunk, None, max(fwd, bwd), max(fwd, bwd - grads))
        grads = v * h * b + n * h * b + (v * 4 if shape.bias else 0)
        if shape.device == "cuda" and not shape.bias:  # the Triton kernels read and write the weight's dtype
            fwd = c * vf * b
            bwd = grads + n * vg * b + n * h * 4
        elif shape.device == "cuda":  # the Triton kernels on float32 blocks (the bias is added in float32)
            fwd = c * vf * 4 + c * vf * b
            bwd = grads + c * vg * 4 + c * vg * b + n * vg * b + n * h * 4
        else:  # the eager kernels; no half-precision matmul into float32: float32 copies of its operands
            bwd = grads + 2 * c * vg * 4 + n * h * 4 + n * vg * b + c * vg * b + c * h * 4 + vg * h * 4 + c * vg * 4
        return Estimate("head", chunk, None, max(fwd, bwd), max(fwd, bwd - grads))
    if approach == "loss4":  # a statistics pass, then the fused head's backward walk
        from dataclasses import replace

        return replace(estimate("head", shape, chunk), approach="loss4")
    if approach == "loss3":
        working = three_pass_bytes(c, v, h, b, accumulator=half, buffers=2, native=shape.device == "cuda")
        hg, wb = n * h * b, v * 4 if shape.bias else 0
        total = working + hg + wb + (0 if half else v * h * 4)
        if half:  # backward: the float32 sum beside the weight gradient it is rounded into
            total = max(total, v * h * 4 + v * h * b + hg + wb)
        return Estimate("loss3", chunk, None, total, working)
    raise ValueError(f"unknown approach {approach!r}")


def loss_walk(shape: Shape, chunk: int, budget: int = WORKING_BYTES) -> int:
    """The GEMM passes ``linear_policy_loss`` takes at ``chunk`` under a working-memory ``budget``
    (``Chunking.max_working_bytes``), without ``vocab_chunk_size`` or ``main_grad`` (the rule of
    :func:`chunked_entropy._logit_blocks.three_pass_plan`): 3 where the three-pass walk fits (float32 weights
    whose shard is one forward block always), else 4."""
    c = min(chunk, shape.tokens)
    if shape.b == 4 and blocks(shape, c)[0] >= shape.v_local:
        return 3
    return 3 if estimate("loss3", shape, chunk).working <= budget else 4


def estimate_rows(shape: Shape, chunk: int, read: int) -> Estimate:
    """The fused head with ``rows="kept"`` when ``read`` percent of the rows are read (``M = N * read / 100``):
    the larger of its two phases. The chunk loop's backward: the head's estimate over ``M`` tokens plus the
    ``[M, H]`` gather of the rows, kept for it (``M*H*B``). Then the rows' ``[M, H]`` gradient added into the
    full ``[N, H]`` one: the head's gradients over ``M`` tokens plus ``N*H*B``. Its matmul work is
    ``read / 100`` of the head's on all rows."""
    from dataclasses import replace

    n, h, b = shape.tokens, shape.hidden, shape.b
    m = n * read // 100
    e = estimate("head", replace(shape, tokens=max(m, 1)), chunk)
    total = max(e.total + m * h * b, e.total - e.working + n * h * b)
    return replace(e, read=read, total=total)


def estimates(shape: Shape, chunks=DEFAULT_CHUNKS) -> list:
    out = [estimate("plain", shape), estimate("clone", shape)]
    out += [estimate("chunked", shape, c) for c in chunks]
    if shape.hidden:
        out += [estimate("head", shape, c) for c in chunks]
        out += [estimate(a, shape, c) for c in chunks for a in ("loss3", "loss4")]
    return out


@dataclass(frozen=True)
class Recommendation:
    approach: Optional[str]  # "chunked", "head" or None (nothing fits)
    chunk: int
    total: int
    reason: str


def recommend(shape: Shape, budget: Optional[int] = None, chunks=DEFAULT_CHUNKS) -> Recommendation:
    """The approach and chunk_size to use (rule in the module docstring)."""
    cands = sorted({c for c in chunks if c <= MAX_RECOMMENDED_CHUNK} or {min(chunks)}, reverse=True)
    small = [c for c in cands if 2 * min(c, shape.tokens) * shape.v_local * 4 <= shape.logits_bytes / 8]
    cands = small or [min(cands)]
    approaches = ["chunked"] + (["head"] if shape.hidden else [])
    for approach in approaches:
        for c in cands:
            e = estimate(approach, shape, c)
            if budget is None or e.total <= budget:
                why = "largest chunk whose buffers stay within 1/8 of the logits"
                if budget is not None:
                    why += " and whose total fits the budget"
                if approach == "head":
                    why = "the logits path does not fit the budget; " + why
                return Recommendation(approach, c, e.total, why)
    reason = "nothing fits the budget"
    if not shape.hidden:
        reason += " (give --hidden to consider the fused head, which never holds the logits)"
    else:
        reason += "; use a larger --tp, fewer tokens per micro-batch, or vocab_chunk_size with the fused head"
    return Recommendation(None, 0, 0, reason)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"80G"``, ``"512MiB"``, ``"512M"`` or bytes -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {"tib": 2**40, "tb": 2**40, "t": 2**40, "gib": GiB, "gb": GiB, "g": GiB,
             "mib": MiB, "mb": MiB, "m": MiB, "kib": 1024, "kb": 1024, "k": 1024, "b": 1, "": 1}
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            num = t[: len(t) - len(unit)] if unit else t
            try:
                value = float(num)
            except ValueError:
                break
            if not (math.isfinite(value) and value > 0):
                break
            return int(value * units[unit])
    raise argparse.ArgumentTypeError(f"expected a size like 80GiB, 40G or 512MiB, got {text!r}")


def add_arguments(p: argparse.ArgumentParser, positive_int, int_list) -> None:
    p.add_argument("--tokens", type=positive_int, required=True,
                   help="tokens per micro-batch on this rank (batch x sequence length), e.g. 16384")
    p.add_argument("--vocab", type=positive_int, required=True,
                   help="global vocabulary size (padded, as the model holds it), e.g. 151936")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="hidden size H of the lm_head; adds the fused head to the table")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size: each rank holds vocab/tp columns (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32",
                   help="dtype of the logits (or of the hidden states and weight) (default float32)")
    p.add_argument("--budget", type=parse_size, default=None,
                   help="memory available for the loss head per rank, e.g. 8GiB; "
                        "the recommendation must fit it (default: no limit)")
    p.add_argument("--bias", action="store_true", help="the lm_head has a bias (fused head estimate)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where it runs: a CPU has no half-precision matmul into float32, so a bf16/fp16 fused "
                        "head's backward holds float32 copies of its operands there (default cuda)")
    p.add_argument("--chunk-sizes", type=int_list, default=list(DEFAULT_CHUNKS), metavar="C1,C2,...",
                   help="chunk sizes to list (default " + ",".join(map(str, DEFAULT_CHUNKS)) + ")")
    p.add_argument("--max-working-bytes", type=parse_size, default=WORKING_BYTES, metavar="SIZE",
                   help="with --hidden: the fused loss's working-memory budget, Chunking.max_working_bytes: it "
                        "takes 3 GEMM passes where that walk (a float32 weight-gradient accumulator included) "
                        "fits, else 4 (default 1GiB)")
    p.add_argument("--read", type=positive_int, default=None, metavar="PERCENT",
                   help="with --hidden: only that percent of the rows is read (rows='kept'); adds the fused head "
                        "on those rows to the table, and its share of the all-rows head's time")


def run(args) -> int:
    shape = Shape(args.tokens, args.vocab, args.hidden or 0, args.tp, args.dtype, args.bias, args.device)
    rows = estimates(shape, args.chunk_sizes)
    read = getattr(args, "read", None)
    if read is not None and (not shape.hidden or read > 100):
        raise argparse.ArgumentTypeError("--read needs --hidden and a percent in [1, 100]")
    if read is not None:
        rows += [estimate_rows(shape, c, read) for c in args.chunk_sizes]
    rec = recommend(shape, args.budget, args.chunk_sizes)
    print(
        f"Memory of one forward+backward of log-probs and entropy, per rank: tokens={shape.tokens}, "
        f"vocab={shape.vocab} (V_local={shape.v_local} at tp={shape.tp}), "
        + (f"hidden={shape.hidden}, " if shape.hidden else "")
        + f"{shape.dtype}. The logits alone are {fmt_bytes(shape.logits_bytes)}."
    )
    print()
    print("| approach | over the logits | total (logits made in the step) | fits budget |")
    print("|---|---:|---:|:---:|")
    for e in rows:
        fits = "-" if args.budget is None else ("yes" if e.total <= args.budget else "no")
        print(f"| {e.label} | {fmt_bytes(e.over_logits)} | {fmt_bytes(e.total)} | {fits} |")
    print()
    print("'over the logits': peak on top of logits that already exist (includes their gradient).")
    print("'total': peak when the lm_head matmul runs in the step (includes the logits it makes).")
    heads = [e for e in rows if e.working is not None and not e.read and e.approach == "head"]
    if heads:
        print("Fused head's working memory, beyond its inputs and their gradients: "
              + ", ".join(f"chunk {e.chunk}: {fmt_bytes(e.working)}" for e in heads) + ".")
    budget = getattr(args, "max_working_bytes", WORKING_BYTES)
    for e in (e for e in rows if e.approach == "loss3"):
        passes = loss_walk(shape, e.chunk, budget)
        why = (f"its working memory, {fmt_bytes(e.working)}" + (" with a float32 weight-gradient accumulator of "
               f"{fmt_bytes(shape.v_local * shape.hidden * 4)}" if shape.b != 4 else "")
               + f", {'fits' if e.working <= budget else 'exceeds'} max_working_bytes={fmt_bytes(budget)}")
        if shape.b == 4 and e.working > budget:
            why = "float32 weights whose shard is one vocabulary block: the walk holds nothing more"
        print(f"linear_policy_loss at chunk {e.chunk} takes {passes} GEMM passes (the three-pass walk: {why}).")
    if read is not None:
        print(f"rows='kept' with {read}% of the rows read: every matmul pass over {read}% of the tokens, so about "
              f"{read / 100:.2f} of the all-rows head's time (plus an [M, H] gather and an index_add_ into the "
              "hidden gradient).")
    if args.budget is not None:
        print(f"Budget: {fmt_bytes(args.budget)} per rank.")
    print()
    if rec.approach is None:
        print(f"Recommendation: {rec.reason}.")
        return 1
    if rec.approach == "chunked":
        call = f"log_probs_and_entropy(logits, labels, chunking={rec.chunk})"
    else:
        call = f"linear_log_probs_and_entropy(hidden, weight, labels, chunking={rec.chunk})"
    print(f"Recommendation: chunk_size={rec.chunk} with the "
          f"{'logits path' if rec.approach == 'chunked' else 'fused head'}, "
          f"about {fmt_bytes(rec.total)} per rank ({rec.reason}).")
    print(f"    {call}")
    if rec.approach == "chunked" and shape.hidden:
        head = estimate("head", shape, rec.chunk)
        print(f"The fused head (linear_log_probs_and_entropy, chunk_size={rec.chunk}) would need about "
              f"{fmt_bytes(head.total)}: it never holds the logits.")
    return 0
