"""What a call costs: the memory it allocates (:class:`AllocationLog`), and the CUDA branch on a CPU with what a
call would cost on a GPU there (:func:`cuda_branch` and its :class:`GpuLog`).

Layer: a tool beside the ops (it switches the core's device branches; no op imports it). For tests, the
bench (``--allocations``, ``--traffic``), and anyone who wants to read a call's memory or GPU plumbing
without a GPU.

:class:`AllocationLog` is the one allocation counter of the tests and the bench: the peak of the bytes torch's
CPU allocator holds inside a ``with`` block, over those it held on entry, read from torch's profiler (it
changes nothing in what the block runs). :class:`GpuLog` keeps its own log of the allocations (it needs each
one's shape, to scale it back to a full shape) and replays it the same way (:func:`_peak`).

A CUDA device takes branches a CPU does not: half-precision matmuls into a float32 result
(``torch.mm(..., out_dtype=torch.float32)``, which CPU torch lacks), and ``backend="auto"`` choosing the
Triton kernels. Inside ``with cuda_branch() as log:`` a CPU run takes every one of them:

- ``chunked_entropy._autograd.casts_in_kernel`` says yes (an op over mixed dtypes is one pass);
- ``chunked_entropy._logit_blocks.half_mm_native`` and ``half_addmm_native`` say yes on the CPU, and the
  ``mm.dtype`` / ``mm.dtype_out`` and ``addmm.dtype`` / ``addmm.dtype_out`` overloads CPU torch lacks are
  served as a CUDA kernel computes them (float32 accumulation of the half-precision products, added once to
  an accumulator for ``addmm``, written once in ``out_dtype``);
- ``backend="auto"`` treats the CPU as a fast device and chooses the Triton kernels, run through Triton's
  interpreter; its first-call probe runs on entering, outside the log. The interpreter must be on before
  Triton is imported (its own library functions are decorated then): set ``TRITON_INTERPRET=1`` in the
  environment, or enter ``cuda_branch()`` before anything imports Triton (it then sets the variable, and
  every Triton kernel of the process is interpreted). Without an importable Triton, or with Triton
  already imported compiled, entering raises ``RuntimeError`` saying why.

While the block is open, ``log`` (a ``TorchDispatchMode``) counts what each dispatched op would cost on a GPU:

- **launches**: one per aten op that does work (views, ``empty``, the 0-d tensor of a Python number and ops
  on zero elements launch nothing),
  plus one per Triton kernel launch; a matmul counts one (``gemms`` counts them apart);
- **traffic**: bytes read and written by every op that is not a matmul, by the tensors it is handed
  (inputs read, outputs written; ``copy_``/``fill_``/``zero_`` do not read their destination; a stride-0
  dimension is read once). A Triton launch counts the tensors its launch wrapper passes: the block it
  reads and the gradient block it writes (each kernel reads its block once and writes its output once; the
  interpreter itself runs outside the log). Traffic is split by the largest tensor an op touches:
  ``logit_bytes`` where it has two or more dimensions of 16 or more and none equal to ``hidden`` (the
  ``[rows, columns]`` blocks of logits and their gradients), ``hidden_bytes`` where a dimension is
  ``hidden``, ``vector_bytes`` otherwise (per-row vectors);
- **memory**: every allocation (an op's fresh output: not a view, not in place, not ``out=``) and its
  release (when its storage is freed), in order. :meth:`GpuLog.working_bytes` replays them: the peak of what
  was live beyond the tensors still alive when the block closes (the call's results: its outputs and the
  gradients of its inputs), optionally with each allocation scaled back (``scale``: every dimension of 16 or
  more multiplied by ``scale``, one equal to ``hidden`` by ``hidden_scale``).

Scaled shapes (``scale=s``): the byte budgets that choose the vocabulary blocks and the hand-over rows
(:data:`chunked_entropy.config.CHUNK_BUFFER_BYTES`, :data:`~chunked_entropy.config.GRAD_BUFFER_BYTES`,
:data:`chunked_entropy._autograd.HAND_OVER_BYTES`) are divided by ``s**2`` while the block is open, so that
a call on ``N/s`` tokens and ``V/s`` columns walks as many chunks and vocabulary blocks as the full shape
(``chunk_size/s`` rows a chunk), and each allocation's bytes scale back to the full shape's. The fused loss's
choice of walk (three GEMM passes where :func:`chunked_entropy.config.three_pass_bytes` fits
``Chunking.max_working_bytes``) is made on the full shape's bytes (rows and columns times ``s``, the hidden
size times ``hidden_scale``): the scaled call takes the walk the full one takes. Launch counts and traffic
per logit need no scaling: both are the full shape's when the block counts are.

The Triton kernels (:mod:`chunked_entropy._triton`: the statistics, the second stage merging a split row's
parts, the gradient) are each counted at every ``kernel[grid](...)`` launch, and run through the interpreter
or by a torch stand-in of the same arguments and outputs. ``_triton.AUTOTUNE`` is off while the block is
open: each launch takes the tile and warps the interpreter's always do (a GPU's autotuner times its
candidates once per shape class, then launches each kernel as often a call as here). Rows split across
programs (``_triton._parts``) follow the CPU's program count (8), not a GPU's: the split launches of a few
long rows are counted and checked on the CPU, and at the H200 shapes scaled no chunk splits.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _autograd, _kernels, _logit_blocks, config

__all__ = ["AllocationLog", "GpuLog", "cuda_branch"]

aten = torch.ops.aten

#: Matmuls: one GEMM pass each, not elementwise traffic.
_GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear, aten.addmv, aten.mv, aten.dot,
          aten.addbmm}
#: Ops that launch no kernel (allocation without initialisation, metadata, and ``scalar_tensor``: a Python
#: number an op takes, such as ``torch.where(c, x, 0.0)``'s, is a host-side 0-d tensor on CUDA).
_NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided,
              aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size,
              aten.lift_fresh, aten.resize_, aten.scalar_tensor}
#: In-place ops that write their first argument without reading it.
_WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_, aten.random_}
#: The smallest dimension that counts as a scaled one (rows, columns, hidden); smaller ones (a 6 of stacked
#: statistics, a K of ids, a 1) are the same at every scale.
_MIN_DIM = 16


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _read_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s distinct elements (a stride-0 dimension is read once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _peak(events) -> tuple:
    """``(peak, final)`` of the running sum of ``events`` in order (bytes: allocated > 0, freed < 0), from 0:
    what was live at most, and at the end, over what was live before the first event."""
    live = peak = 0
    for nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live


class AllocationLog:
    """The peak of the bytes torch's CPU allocator holds inside a ``with`` block, over those it held on entry.

    Every allocation and free of tensor memory inside the block is logged, in order, by torch's profiler
    (``profile_memory=True``: one event per allocation or free, with its size), on the thread that enters
    the block (a CPU backward runs there too; other threads are not logged); ``peak`` is the largest running
    sum (:func:`_peak`), ``net`` what is still held at the end over what was held on entry (a call's results:
    its outputs, its inputs' gradients). A free of a block allocated before entry is not logged (the
    profiler warns once): such memory counts as held throughout, so free the tensors of an earlier pass
    before entering. The figure depends only on the tensors the code creates and frees, not on what the C
    library keeps or returns, on page faults, or on other processes: the same call gives the same figure on a
    busy machine as on an idle one. It leaves out what the libraries underneath allocate themselves (the
    matmul library's packing workspace: a few MiB) and Python objects. Unlike a ``TorchDispatchMode`` it
    changes nothing in what runs (under a Python dispatch mode torch takes other paths for some ops, e.g.
    ``F.linear_cross_entropy``, which then allocate more). The profiler slows the block down: time it
    separately.

    Example:
        >>> x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB, held on entry: not counted
        >>> with AllocationLog() as log:
        ...     (x.exp() * 2).sum().backward()
        >>> log.peak >= 3 * 2**20  # exp's output (saved), the product, its gradient, x.grad
        True
    """

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        cpu = torch._C._autograd.DeviceType.CPU
        events = [e for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == cpu]
        self.peak, self.net = _peak(e.nbytes() for e in sorted(events, key=lambda e: e.start_ns()))


class GpuLog(TorchDispatchMode):
    """What the ops dispatched while it is active would cost on a GPU (see the module docstring).

    ``hidden``: the hidden size of the call (its dimension sorts traffic into ``hidden_bytes`` and scales by
    ``hidden_scale``); ``scale``: the factor of every other dimension of 16 or more, for
    :meth:`working_bytes`.
    """

    def __init__(self, hidden: Optional[int] = None, scale: float = 1.0, hidden_scale: Optional[float] = None):
        super().__init__()
        self.hidden, self.scale = hidden, scale
        self.hidden_scale = scale if hidden_scale is None else hidden_scale
        self.paused = False
        self.reset()

    def reset(self) -> None:
        """Forget what was counted (the allocations still alive are not counted again)."""
        self.launches = 0
        self.gemms = 0
        self.half_mms = 0  # matmuls of half-precision operands into a wider result (mm.dtype, served)
        self.triton_launches = 0
        self.ops = Counter()
        self.logit_bytes = self.hidden_bytes = self.vector_bytes = 0
        self._events = []  # (id, bytes, scaled bytes) at an allocation, (id, None, None) at its release
        self._alive = {}  # id -> (bytes, scaled bytes) of allocations not yet released
        self._next = 0

    # ------------------------------------------------------------------ counting

    def _kind(self, tensors) -> str:
        big = max(tensors, key=lambda t: t.numel(), default=None)
        if big is None:
            return "vector"
        if self.hidden is not None and self.hidden in big.shape:
            return "hidden"
        return "logit" if sum(1 for d in big.shape if d >= _MIN_DIM) >= 2 else "vector"

    def _traffic(self, read, written) -> None:
        n = sum(_read_bytes(t) for t in read) + sum(t.numel() * t.element_size() for t in written)
        kind = self._kind(list(read) + list(written))
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + n)

    def _scaled(self, t: torch.Tensor) -> float:
        f = 1.0
        for d in t.shape:
            if self.hidden is not None and d == self.hidden:
                f *= self.hidden_scale
            elif d >= _MIN_DIM:
                f *= self.scale
        return f

    def _allocated(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if not nbytes:
            return
        i = self._next
        self._next += 1
        scaled = nbytes * self._scaled(t) if t.numel() * t.element_size() == nbytes else nbytes * self.scale ** 2
        self._alive[i] = scaled
        self._events.append((i, nbytes, scaled))
        weakref.finalize(storage, self._released, i)

    def _released(self, i: int) -> None:
        if self._alive.pop(i, None) is not None:
            self._events.append((i, None, None))

    def launched(self, name: str, read, written) -> None:
        """A kernel launched outside aten (a Triton kernel): its tensors read and written."""
        self.launches += 1
        self.triton_launches += 1
        self.ops[name] += 1
        self._traffic(read, written)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.mm.dtype, aten.mm.dtype_out):
            out = self._serve_mm(func, args, kwargs)
            self.half_mms += not self.paused
        elif func in (aten.addmm.dtype, aten.addmm.dtype_out):
            out = self._serve_addmm(func, args, kwargs)
            self.half_mms += not self.paused
        else:
            out = func(*args, **kwargs)
        if not self.paused:
            self._account(func, args, kwargs, out)
        return out

    @staticmethod
    def _serve_mm(func, args, kwargs):
        """``mm.dtype(_out)`` as a CUDA kernel forms it: the half-precision products accumulated in float32
        (exact products: float32 copies of the operands give the same sum), written in ``out_dtype``."""
        a, b = args[0], args[1]
        out_dtype = args[2] if len(args) > 2 else kwargs["out_dtype"]
        if not (a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype):
            raise TypeError(f"mm with out_dtype takes two half-precision operands, got {a.dtype} and {b.dtype}")
        res = torch.mm(a.to(torch.float32), b.to(torch.float32))
        if func is aten.mm.dtype_out:
            return kwargs["out"].copy_(res)
        return res.to(out_dtype)

    @classmethod
    def _serve_addmm(cls, func, args, kwargs):
        """``addmm.dtype(_out)`` as a CUDA kernel forms it with ``beta = alpha = 1``: the half-precision products
        summed in float32 (:meth:`_serve_mm`), added once to ``self`` (the float32 accumulator, which may be
        ``out`` itself), written in ``out_dtype``: the bits of ``acc.add_(torch.mm(a, b, out_dtype=...))``."""
        acc, a, b = args[0], args[1], args[2]
        out_dtype = args[3] if len(args) > 3 else kwargs["out_dtype"]
        if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
            raise NotImplementedError("cuda_branch serves addmm with out_dtype for beta = alpha = 1 only")
        res = acc.to(out_dtype) + cls._serve_mm(aten.mm.dtype, (a, b, out_dtype), {})
        if func is aten.addmm.dtype_out:
            return kwargs["out"].copy_(res)
        return res

    def _account(self, func, args, kwargs, out) -> None:
        packet = func.overloadpacket
        outs = _tensors(out)
        ins = _tensors(args) + [t for k, v in kwargs.items() if k != "out" for t in _tensors(v)]
        if func.is_view or packet in _NO_KERNEL:
            fresh = packet in _NO_KERNEL and not func._schema.is_mutable
            if fresh:
                for t in outs:
                    self._allocated(t)
            return
        if all(t.numel() == 0 for t in ins + outs):
            return
        self.launches += 1
        self.ops[str(packet).split(".")[-1]] += 1
        if packet in _GEMMS:
            self.gemms += 1
        else:
            if packet in _WRITE_ONLY:
                ins = ins[1:]
            self._traffic(ins, outs)
        for t, ret in zip(outs, func._schema.returns, strict=False):
            if ret.alias_info is None:
                self._allocated(t)

    # ------------------------------------------------------------------ results

    def working_bytes(self, scaled: bool = True) -> float:
        """The peak, over the allocations logged, of what was live beyond the allocations still alive now
        (the results: a call's outputs and its inputs' gradients, which the caller holds): the call's working
        memory. ``scaled``: each allocation's bytes scaled back to the full shape (``scale``,
        ``hidden_scale``); else as allocated."""
        return self._replay(scaled, skip=set(self._alive))

    def peak_bytes(self, scaled: bool = False) -> float:
        """The peak, over the allocations logged, of what was live at once, the results included: what the
        ops allocated over what existed on entry (the memory tests' measure on the CPU: the tensors the ops
        return, not what a CPU kernel allocates inside itself, which :class:`AllocationLog` counts too).
        ``scaled`` as in :meth:`working_bytes`; by default as allocated."""
        return self._replay(scaled, skip=())

    def _replay(self, scaled: bool, skip) -> float:
        sizes = {}

        def events():
            for i, raw, big in self._events:
                if i in skip:
                    continue
                if raw is None:
                    yield -sizes.pop(i)
                else:
                    sizes[i] = big if scaled else raw
                    yield sizes[i]

        return float(_peak(events())[0])

    def summary(self, logits: int) -> dict:
        """A dict of the figures per call over ``logits`` (``N * V``) logits: launches, GEMMs, bytes a logit of
        elementwise traffic over logit blocks (and of the hidden-sized tensors), working memory (scaled)."""
        return {"launches": self.launches, "gemms": self.gemms, "triton_launches": self.triton_launches,
                "logit_bytes_per_logit": self.logit_bytes / logits, "hidden_bytes": self.hidden_bytes,
                "working_bytes": self.working_bytes()}


class _CountedKernel:
    """A Triton kernel whose launches ``kernel[grid](...)`` the active :class:`GpuLog` counts. The launch runs
    with the log paused: through the interpreter (``stand_in`` None), or as ``stand_in(grid, *args, **kwargs)``,
    the same math in torch (:func:`_stats_stand_in`, :func:`_merge_parts_stand_in`, :func:`_grad_stand_in`).
    Only ``kernel[grid](...)`` is served: the launch wrappers launch it so while :func:`cuda_branch` has
    ``_triton.AUTOTUNE`` off (an autotuner wrapping it would launch past the count)."""

    def __init__(self, kernel, name: str, state: dict, writes: tuple, stand_in=None):
        self.kernel, self.name, self.state, self.writes, self.stand_in = kernel, name, state, writes, stand_in

    def __getitem__(self, grid):
        if self.stand_in is None:
            launch = self.kernel[grid]
        else:
            def launch(*args, **kwargs):
                return self.stand_in(grid, *args, **kwargs)

        def run(*args, **kwargs):
            log = self.state.get("log")
            if log is None or log.paused:
                return launch(*args, **kwargs)
            tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            blocks = [(i, a) for i, a in tensors if a.dim() >= 2]
            read = [a for i, a in blocks if i not in self.writes]
            written = [a for i, a in blocks if i in self.writes]
            log.launched(self.name, read, written)
            log.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                log.paused = False

        return run


_TORCH = {"fp32": torch.float32, "fp64": torch.float64}


def _column(ptr, stride, n: int, dtype, present: bool = True):
    """A per-row input the kernels read at ``ptr + row * stride``, as an ``[n, 1]`` column; 1 where it is absent
    (``present``: the kernels' ``HAS_K``)."""
    if not present:
        return torch.ones(n, 1, dtype=dtype, device=ptr.device)
    return (ptr.reshape(-1)[:1].expand(n) if stride == 0 else ptr.reshape(-1)[:n]).to(dtype).reshape(n, 1)


def _merged_into(dsts, st, col, meta) -> None:
    """``st`` (a row's statistics) written into ``dsts`` (``m, ones, rest, w, q, zl``; ``w``, ``q`` only where
    wanted), merged first with the running statistics they hold where ``meta["MERGE"]``
    (:func:`chunked_entropy._stats.merge_stats`, the running side first, as ``_merge_running``)."""
    from . import _stats

    wanted = (True, True, True, meta["WANT_W"], meta["WANT_Q"], True)
    if meta["MERGE"]:
        running = _stats.BlockStats(*(d if on else None for d, on in zip(dsts, wanted, strict=True)))
        st = _stats.merge_stats(running, st, col)
    for dst, src, on in zip(dsts, st, wanted, strict=True):
        if on:
            dst.copy_(src)


def _stats_stand_in(grid, z, szr, szc, width, span, cap, k, sk, target, v0, m, ones, rest, w, q, zl, n,
                    span_class, **meta):
    """``_stats_kernel``'s outputs from :func:`chunked_entropy._stats.stats_of_block` (the compiled backend's
    math, run eagerly; reassociated sums, within a few ulps of the kernel's): program ``(row, part)`` of the
    grid ``(n, parts)`` holds columns ``[part * span, (part + 1) * span)`` and writes its statistics at
    ``part * n + row`` (``w``, ``q`` only where wanted); ``zl`` (``[n]``) gets the label's ``u`` from the part
    holding it, 0 where no part does. ``MERGE`` (one part): merged into the running statistics the outputs
    hold (:func:`_merged_into`)."""
    from . import _stats

    dtype = _TORCH[str(meta["COMPUTE"])]
    parts = grid[1] if len(grid) > 1 else 1
    col = _column(k, sk, n, dtype, meta["HAS_K"])
    if meta["MERGE"]:
        st = _stats.stats_of_block(z, cap.reshape(()) if meta["HAS_CAP"] else None, col, target, v0, dtype)
        _merged_into((m, ones, rest, w, q, zl), st, col, meta)
        return
    label = None
    for part in range(parts):
        lo, hi = part * span, min((part + 1) * span, width)
        if lo >= hi:
            continue
        st = _stats.stats_of_block(z[:, lo:hi], cap.reshape(()) if meta["HAS_CAP"] else None, col, target,
                                   v0 + lo, dtype)
        at = slice(part * n, (part + 1) * n)
        for dst, src, wanted in zip((m, ones, rest, w, q), st[:5],
                                    (True, True, True, meta["WANT_W"], meta["WANT_Q"]), strict=True):
            if wanted:
                dst[at].copy_(src)
        label = st.zl if label is None else label + st.zl  # 0 from every part but the label's
    zl[:n].copy_(label)


def _merge_parts_stand_in(grid, pm, pones, prest, pw, pq, pzl, parts, n, k, sk, m, ones, rest, w, q, zl, **meta):
    """``_merge_parts_kernel``'s outputs: the ``parts`` partial statistics of each row (at ``part * n + row``)
    merged by :func:`chunked_entropy._stats.merge_stats` (an online softmax over the parts, in order), the
    label's ``u`` from ``pzl``; ``MERGE``: then merged into the running statistics (:func:`_merged_into`)."""
    from . import _stats

    dtype = _TORCH[str(meta["COMPUTE"])]
    col = _column(k, sk, n, dtype, meta["HAS_K"])
    want_w, want_q = meta["WANT_W"], meta["WANT_Q"]
    merged = None
    zero = torch.zeros(n, dtype=dtype, device=pm.device)
    for part in range(parts):
        at = slice(part * n, (part + 1) * n)
        st = _stats.BlockStats(pm[at].to(dtype), pones[at].to(dtype), prest[at].to(dtype),
                               pw[at].to(dtype) if want_w else None, pq[at].to(dtype) if want_q else None, zero)
        merged = _stats.merge_stats(merged, st, col)
    _merged_into((m, ones, rest, w, q, zl), merged._replace(zl=pzl[:n].to(dtype)), col, meta)


def _grad_stand_in(grid, z, szr, szc, out, sor, soc, width, span, cap, k, sk, m, ls, ws, s2, target, v0, c, b, a,
                   span_class, **meta):
    """``_grad_kernel``'s output from :func:`chunked_entropy._stats.grad_of_block` (run eagerly): every column's
    gradient is its own, so the grid's parts (columns ``[part * span, (part + 1) * span)`` each) are the block
    at once."""
    from . import _stats

    dtype = _TORCH[str(meta["COMPUTE"])]
    n = z.shape[0]
    zero = torch.zeros(n, dtype=dtype, device=z.device)
    on = lambda flag, t: t.to(dtype) if meta[flag] else zero  # noqa: E731
    res = torch.empty(z.shape, dtype=dtype, device=z.device)
    _stats.grad_of_block(z, res, cap.reshape(()) if meta["HAS_CAP"] else None,
                         _column(k, sk, n, dtype, meta["HAS_K"]), m, ls, on("HAS_B", ws), on("HAS_A", s2), target, v0,
                         on("HAS_C", c), on("HAS_B", b), on("HAS_A", a), dtype)
    out.copy_(res)


def _triton_module(interpret: bool):
    """:mod:`chunked_entropy._triton`, through Triton's interpreter with ``interpret``. Raises RuntimeError
    where Triton cannot be imported, or (``interpret``) was imported with its kernels compiled: the
    interpreter must be switched on before Triton is imported (its own library functions are decorated then)."""
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(f"cuda_branch() counts the Triton kernels' launches: install triton ({e})") from e
    mod = _kernels.TRITON.module()
    if mod is None:
        raise RuntimeError(f"cuda_branch(): {_kernels.TRITON.why_not(torch.device('cpu'))}")
    if interpret and not mod.INTERPRETED:
        raise RuntimeError("cuda_branch(interpret=True) runs the Triton kernels through Triton's interpreter, "
                           "which must be switched on before Triton is imported: set TRITON_INTERPRET=1 in the "
                           "environment, or enter cuda_branch(interpret=True) before anything imports triton "
                           f"({triton.__version__})")
    return mod


@contextlib.contextmanager
def _counted(mod, state: dict, interpret: bool):
    """The module's three kernels (the statistics, the second stage of split rows, the gradient) counted by the
    log in ``state`` while the block is open; run through the interpreter (``interpret``) or by their
    stand-ins. ``mod.AUTOTUNE`` is off meanwhile: each launch takes :func:`~chunked_entropy._triton._stats_config`
    / ``_grad_config``'s tile, as the interpreter's always do (a GPU's autotuner times its candidates once per
    shape class, then launches the kernel once a call as here: the same launches a call)."""
    kernels = {"_stats_kernel": ("triton_stats", (), _stats_stand_in),
               "_merge_parts_kernel": ("triton_merge_parts", (), _merge_parts_stand_in),
               "_grad_kernel": ("triton_grad", (3,), _grad_stand_in)}  # (3,): the position of ``out``
    saved = {name: getattr(mod, name) for name in kernels}
    autotune = mod.AUTOTUNE
    try:
        mod.AUTOTUNE = False
        for name, (label, writes, stand_in) in kernels.items():
            setattr(mod, name, _CountedKernel(saved[name], label, state, writes, None if interpret else stand_in))
        yield
    finally:
        mod.AUTOTUNE = autotune
        for name, kernel in saved.items():
            setattr(mod, name, kernel)


@contextlib.contextmanager
def cuda_branch(*, hidden: Optional[int] = None, scale: int = 1, hidden_scale: Optional[float] = None,
                log: bool = True, interpret: bool = False) -> Iterator[GpuLog]:
    """Run CPU calls down the CUDA branch, counting what they would cost on a GPU (see the module docstring).

    Args:
        hidden: the calls' hidden size (sorts traffic, scales allocations by ``hidden_scale``).
        scale: the shapes are the full ones divided by ``scale`` (token count, vocabulary, chunk size): the
            byte budgets that choose vocabulary blocks are divided by ``scale**2`` meanwhile, and
            :meth:`GpuLog.working_bytes` scales each allocation back.
        hidden_scale: the hidden size's own factor (default ``scale``).
        log: count from the start (else ``log.paused`` is set: unpause it around what is measured).
        interpret: run the Triton kernels through Triton's interpreter (exact, slow: seconds per block);
            else each launch is counted by its arguments and computed by a stand-in, the compiled
            backend's math (:func:`chunked_entropy._stats.stats_of_block`, ``grad_of_block``) run eagerly
            with the log paused: the same outputs within a few ulps, the same buffers and dtypes.

    Yields the :class:`GpuLog` (active for the whole block).

    Raises:
        RuntimeError: Triton, or its interpreter, cannot run here.
    """
    mod, state = _triton_module(interpret), {}
    saved = {(config, "CHUNK_BUFFER_BYTES"): config.CHUNK_BUFFER_BYTES,
             (config, "GRAD_BUFFER_BYTES"): config.GRAD_BUFFER_BYTES,
             (_autograd, "HAND_OVER_BYTES"): _autograd.HAND_OVER_BYTES,
             (_logit_blocks, "half_mm_native"): _logit_blocks.half_mm_native,
             (_logit_blocks, "half_addmm_native"): _logit_blocks.half_addmm_native,
             (_autograd, "casts_in_kernel"): _autograd.casts_in_kernel,
             (_logit_blocks, "three_pass_bytes"): _logit_blocks.three_pass_bytes}
    s2 = scale * scale
    the_log = GpuLog(hidden=hidden, scale=scale, hidden_scale=hidden_scale)
    three_pass_bytes, grad_buffer = saved[_logit_blocks, "three_pass_bytes"], saved[config, "GRAD_BUFFER_BYTES"]

    h_factor = scale if hidden_scale is None else hidden_scale

    def full_three_pass_bytes(rows, v_local, hdim, itemsize, **kw):
        """The fused loss's three-pass walk's working memory at the full shape (``rows``, ``v_local`` times
        ``scale``, ``hdim`` times its own factor, the full gradient budget): the call takes the walk the full
        shape takes within ``Chunking.max_working_bytes``."""
        grad_scaled = config.GRAD_BUFFER_BYTES
        config.GRAD_BUFFER_BYTES = grad_buffer
        try:
            return three_pass_bytes(rows * scale, v_local * scale, round(hdim * h_factor),
                                    itemsize, **kw)
        finally:
            config.GRAD_BUFFER_BYTES = grad_scaled

    try:
        config.CHUNK_BUFFER_BYTES = max(1, saved[config, "CHUNK_BUFFER_BYTES"] // s2)
        config.GRAD_BUFFER_BYTES = max(1, saved[config, "GRAD_BUFFER_BYTES"] // s2)
        _autograd.HAND_OVER_BYTES = max(1, saved[_autograd, "HAND_OVER_BYTES"] // s2)
        _logit_blocks.half_mm_native = lambda device: True
        _logit_blocks.half_addmm_native = lambda device: True
        _autograd.casts_in_kernel = lambda device: True
        _logit_blocks.three_pass_bytes = full_three_pass_bytes
        with _kernels.TRITON.as_compiled(), _kernels.fast_device("cpu"), _counted(mod, state, interpret):
            _kernels.choose_kernels("auto", torch.device("cpu"))  # the first-call probe, outside the log
            if _kernels.choose_kernels("auto", torch.device("cpu")) is not _kernels.TRITON:
                raise RuntimeError("cuda_branch(): backend='auto' did not choose the interpreted Triton kernels "
                                   "(see the warning above)")
            state["log"] = the_log
            the_log.paused = not log
            try:
                with the_log:
                    yield the_log
            finally:
                state.pop("log", None)
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


#: The shapes of the issue's H200 figures: ``(tokens, vocabulary, hidden, chunk_size)`` per op.
H200_SHAPES = {
    "head": (8192, 151936, 4096, 1024),
    "loss": (8192, 151936, 4096, 1024),
    "logits": (16384, 152064, 0, 1024),
    "logits_forward": (16384, 152064, 0, 1024),
}
#: What :func:`measure` runs: the fused head's log-probs + entropy, ``linear_policy_loss`` (vanilla PPO with an
#: entropy bonus), the logits path forward + backward, and its forward alone under ``no_grad``.
OPS = tuple(H200_SHAPES)


def measure(op: str, *, scale: int = 32, dtype=torch.bfloat16, shape: Optional[tuple] = None,
            hidden: Optional[int] = None, seed: int = 0) -> dict:
    """One call of ``op`` (:data:`OPS`) with random upstream gradients, at ``shape`` (default
    :data:`H200_SHAPES`) divided by ``scale``, down the CUDA branch (:func:`cuda_branch`); its figures at the full
    shape: ``launches`` (kernels a call, forward and backward), ``gemms``, ``triton_launches``,
    ``bytes_per_logit`` (elementwise traffic over the ``[rows, columns]`` logit blocks, per logit of the call),
    ``working_bytes`` (the peak of the call's allocations beyond its results, scaled back),
    ``hidden_traffic_bytes`` (elementwise traffic over the ``[*, H]`` tensors: hidden states, weight and
    their gradients, scaled back), ``ops`` (launches by op name: aten's, and the Triton kernels') and the
    shape.
    ``hidden``: the scaled hidden size (default the full one over ``scale``, moved off any block width)."""
    import chunked_entropy as ce

    if op not in H200_SHAPES:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    n_full, v_full, h_full, c_full = shape or H200_SHAPES[op]
    for name, value in (("tokens", n_full), ("vocabulary", v_full), ("chunk_size", c_full)):
        if value % scale:
            raise ValueError(f"the {name} ({value}) must be a multiple of scale ({scale})")
    n, v, c = n_full // scale, v_full // scale, c_full // scale
    h = (hidden or max(8, h_full // scale - 8)) if h_full else 0
    g = torch.Generator().manual_seed(seed)
    ups = torch.randn(2, n, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    with cuda_branch(hidden=h or None, scale=scale, hidden_scale=(h_full / h) if h else None, log=False) as log:
        if op in ("head", "loss"):
            hid = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
            w = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
            leaves = [hid, w]
        else:
            z = (torch.randn(n, v, generator=g) * 3).to(dtype).requires_grad_(op == "logits")
            leaves = [z]
        log.paused = False
        if op == "head":
            out = ce.linear_log_probs_and_entropy(hid, w, labels, chunking=c)
            total = (out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()
        elif op == "loss":
            mask = torch.ones(1, n, dtype=torch.bool)
            total, _ = ce.linear_policy_loss(hid[None], w, labels[None], ups[0][None] - 3.0, ups[1][None], mask,
                                             loss=ce.PolicyLoss(entropy_coeff=0.01), chunking=c)
        elif op == "logits":
            out = ce.log_probs_and_entropy(z, labels, chunking=c)
            total = (out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()
        else:
            with torch.no_grad():
                out = ce.log_probs_and_entropy(z, labels, chunking=c)
            total = None
        grads = torch.autograd.grad(total, leaves) if total is not None else ()
        log.paused = True
        figures = dict(op=op, tokens=n_full, vocab=v_full, hidden=h_full, chunk_size=c_full, scale=scale,
                       launches=log.launches, gemms=log.gemms, triton_launches=log.triton_launches,
                       bytes_per_logit=log.logit_bytes / (n * v), working_bytes=log.working_bytes(),
                       hidden_traffic_bytes=log.hidden_bytes * scale * (h_full / h) if h else 0,
                       ops=dict(log.ops))
        del grads, total
    return figures
