"""Which implementation of the per-block math runs: eager (the reference), compiled, or Triton
(:data:`BACKENDS`, the names ``Chunking.backend`` takes).

``backend="eager"`` runs :func:`chunked_entropy._stats.block_stats` and
:func:`~chunked_entropy._stats.block_grad`: a dozen in-place PyTorch ops per
block in our own buffers. ``backend="compile"`` runs
:func:`~chunked_entropy._stats.stats_of_block` and
:func:`~chunked_entropy._stats.grad_of_block` through ``torch.compile``
(inductor: C++/OpenMP on CPU, Triton on GPU), each fused into one pass: the
statistics read the block once and write per-row vectors; the gradient reads
it once and writes the gradient block. ``backend="triton"`` runs the same
two passes as hand-written Triton kernels (:mod:`chunked_entropy._triton`,
imported on first use: the library works without Triton).

``"auto"`` (every op's default) chooses by device: on CUDA, the Triton
kernels when Triton is importable, else the compiled ones, each tried once on
float32 and bf16 test blocks first (:func:`_probe_block`: several tiles a row,
a soft-cap, per-row temperatures, every statistic and gradient term; a
failure, or results that differ from the eager kernels', warns once and moves
on to the next, down to eager), and a divergence's kernels (:data:`PAIR`) at
that divergence's first call (:func:`_probe_pair`; where they fail, it runs
eagerly). Each probe reads the device once, for its verdict, in the first
call only;
on the CPU and other devices, eager. On a CPU tensor ``backend="triton"``
runs only through Triton's interpreter (opt-in: ``TRITON_INTERPRET=1`` in
the environment before Triton is first imported; slow, for tests).

The loop (:mod:`chunked_entropy._loop`) takes the chosen kernels as an object
with ``stats`` and ``grad`` (:data:`EAGER`, :data:`COMPILED`, :data:`TRITON`:
:func:`choose_kernels`) and asks it, never which one it is, how a block is read
and where its gradient is written (:class:`_Fast`, :class:`_Eager`), and a
divergence's per-block steps (``pair_ready``, ``pair_held``, ``pair_cross``,
``pair_terms``, ``pair_grad``: the eager math of :mod:`chunked_entropy._divergence`
on offsets in our buffers, or the divergence's compiled kernels, :data:`PAIR`, on
the raw blocks, for the Triton backend too). Both ``stats`` take ``out=`` (a ``[6, n]`` tensor
of the walk's running statistics to write into) and ``merge=`` (merge the
block's statistics into what ``out`` holds): the Triton kernel merges inside
its launch; the compiled backend merges eagerly (:func:`_into`).

One compiled kernel of each kind serves every call with the same input dtype and the
same presence of a soft-cap (its value is a tensor, not a constant of the
kernel): the kernels always compute every statistic and every gradient
term (zeros stand for an absent one: a few flops per element in a pass bound
by reading the block), take the temperature as a per-row column, and get
contiguous per-row inputs and at least two rows.

The compiled kernels' shapes are compiled as dynamic (rows, columns, the block's first column), so
chunk sizes, the last partial chunk, vocabulary blocks, token counts and
temperatures reuse one compilation, made on first use in the process.
Collectives stay outside: the kernels see one rank's block.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Optional, Union

import torch

from . import _divergence, _stats

#: The implementations of the per-block math an op's ``backend`` names (``Chunking.backend``).
BACKENDS = ("auto", "eager", "compile", "triton")


def check_backend(value) -> str:
    if value not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {value!r}")
    return value


def k_column(k, n: int, dtype, device) -> torch.Tensor:
    """The per-row multiplier as an ``[n, 1]`` tensor (the compiled kernels take no float constants)."""
    if isinstance(k, torch.Tensor):
        return k
    return torch.full((n, 1), 1.0 if k is None else float(k), dtype=dtype, device=device)


def _read(fill, view, x, a: int, b: int, v0: int, v1: int) -> torch.Tensor:
    """The block to read: the caller's own view when it has one, else ``x`` filled."""
    if view is not None:
        return view(a, b, v0, v1)
    fill(x, a, b, v0, v1)
    return x


def _read_eager(fill, view, x, a: int, b: int, v0: int, v1: int) -> torch.Tensor:
    """The eager kernels' block: the caller's rows where they have ``x``'s dtype (the first op over the block,
    the max and then the offsets, reads them and writes ``x``: ``src`` of
    :func:`chunked_entropy._stats.block_stats`; no copy first), else ``x`` filled. Half-precision rows are
    copied: on the CPU an op that mixes dtypes takes several times a copy plus a same-dtype op."""
    if view is not None:
        z = view(a, b, v0, v1)
        if z.dtype == x.dtype:
            return z
    fill(x, a, b, v0, v1)
    return x


def kernel_k(k, n: int, dtype, device, const: dict, kernels=None):
    """The per-row multiplier ``k`` as the compiled and Triton kernels take it: a per-row tensor as it is;
    None or a float as an ``[n, 1]`` view (stride 0) of a one-element tensor filled once per walk and kept in
    ``const``: one fill a call, not one a launch. None stays None for ``kernels`` that take no multiplier
    (``kernels.k_optional``: the Triton kernels, which then multiply by nothing): no fill at all. The compiled
    kernels (any other ``kernels``: :data:`COMPILED`, :data:`PAIR`) take contiguous columns: an ``[n, 1]`` one
    filled once a walk and chunk size (a stride-0 view would be copied each launch). The eager kernels take
    ``k`` as it is (:meth:`_Eager.k`)."""
    if isinstance(k, torch.Tensor):
        return k
    optional = getattr(kernels, "k_optional", False)
    if k is None and optional:
        return None
    value = 1.0 if k is None else float(k)
    key = value if optional else (value, n)
    t = const.get(key)
    if t is None:
        t = const[key] = torch.full((1, 1) if optional else (n, 1), value, dtype=dtype, device=device)
    return t.expand(n, 1)


def kernel_cap(tf: _stats.Transform, dtype, device, const: dict) -> Optional[torch.Tensor]:
    """The soft-cap's factor ``logit_scale / softcap`` as the compiled and Triton kernels take it, a
    one-element tensor filled once per walk and kept in ``const`` (None without a soft-cap): one fill a call,
    not one a launch."""
    if tf.softcap is None:
        return None
    value = (tf.logit_scale or 1.0) / tf.softcap
    t = const.get(("cap", value))
    if t is None:
        t = const[("cap", value)] = torch.full((1,), value, dtype=dtype, device=device)
    return t


class _Fast:
    """What the chunk loop (:mod:`chunked_entropy._loop`) asks of every kernels object, as the compiled and
    Triton kernels answer it (:class:`_Eager` answers it for the eager ones): the walks call these and never
    ask which kernels they hold.

    These kernels only read a block (the caller's own rows where it has them: :meth:`view`), take the
    multiplier and the soft-cap's factor in their own forms (:meth:`k`, :meth:`cap`, filled once a walk in its
    ``const``), and need no buffer of ours beyond the block (``in_place`` False: no ``exp`` scratch, no cap
    derivative); their statistics merge into running ones (``blocks_outer``: the statistics walk may take
    vocabulary blocks outermost)."""

    #: The kernels write a block's offsets over our buffer and need the ``exp`` scratch and the cap's derivative.
    in_place = False
    #: The statistics merge into a ``[6, n]`` running tensor (``out=``, ``merge=``): blocks may be walked outermost.
    blocks_outer = True

    def view(self, view, tf: _stats.Transform):
        """Where a walk reads its blocks: the caller's own rows (``view``; None: each block filled into ours)."""
        return view

    def read(self, fill, view, x, into, a: int, b: int, v0: int, v1: int) -> tuple:
        """``(z, out)``: the block of rows ``[a, b)``, columns ``[v0, v1)`` to read (``view``'s rows, else ``x``
        filled), and the buffer a gradient of it is written in (``into(a, b)`` when given, else ``x``)."""
        return _read(fill, view, x, a, b, v0, v1), (x if into is None else into(a, b))

    def k(self, k, n: int, dtype, device, const: dict):
        """The multiplier as these kernels take it (:func:`kernel_k`)."""
        return kernel_k(k, n, dtype, device, const, self)

    def cap(self, tf: _stats.Transform, dtype, device, const: dict):
        """The soft-cap's factor as these kernels take it (:func:`kernel_cap`)."""
        return kernel_cap(tf, dtype, device, const)

    def block_stats(self, z, work, scratch, aux, tf, k, target, v0, want_w, want_q, dtype, const, out=None,
                    merge=False) -> _stats.BlockStats:
        """A walk's :meth:`stats` of block ``z`` (``work``, ``scratch``, ``aux``: our buffers, for the eager
        kernels), its multiplier and cap in these kernels' forms from the walk's ``const``."""
        n, dev = z.shape[0], z.device
        return self.stats(z, tf, self.k(k, n, dtype, dev, const), target, v0, want_w, want_q, dtype, out=out,
                          merge=merge, cap=self.cap(tf, dtype, dev, const), work=work, scratch=scratch, aux=aux)

    def block_grad(self, z, out, scratch, aux, tf, k, row, target, v0, co, dtype, const) -> torch.Tensor:
        """A walk's :meth:`grad` of block ``z``, written in ``out``."""
        n, dev = z.shape[0], z.device
        return self.grad(z, out, tf, self.k(k, n, dtype, dev, const), row, target, v0, co, dtype,
                         cap=self.cap(tf, dtype, dev, const), const=const, scratch=scratch, aux=aux)

    def held_grad(self, z, out, scratch, aux, local, merged, tf, k, row, target, v0, co, dtype,
                  const) -> torch.Tensor:
        """The gradient of a block :meth:`block_stats` just read (``local``: its statistics, ``merged``: the
        rows' over the group): these kernels read the raw block again (:meth:`block_grad`)."""
        return self.block_grad(z, out, scratch, aux, tf, k, row, target, v0, co, dtype, const)

    def tile_block(self, z, x) -> tuple:
        """``(x, src, compiled)`` as the invariant mode's tiles take a block
        (:func:`chunked_entropy._tiles.push_block_stats`): these kernels read the raw block ``z`` (read only) with
        their own ``stats``."""
        return z, None, self

    # A divergence's two heads (:class:`chunked_entropy._loop._TeacherWalk`): a student's block ``x`` (transform
    # ``tf``, multiplier ``k``) and a teacher's ``xt`` (``tf_t``, ``k_t``), both in the walk's buffers. These
    # kernels read the raw blocks (the divergence's compiled kernels, :data:`PAIR`, for the Triton backend too),
    # their multipliers as contiguous columns and their soft-caps' factors filled once a walk in ``const``.

    def _pair_constants(self, tf, k, tf_t, k_t, n: int, dtype, device, const: dict) -> tuple:
        """``(k, k_t, cap, cap_t)`` as :data:`PAIR` takes them (:func:`kernel_k`, :func:`kernel_cap`)."""
        return (kernel_k(k, n, dtype, device, const, PAIR), kernel_k(k_t, n, dtype, device, const, PAIR),
                kernel_cap(tf, dtype, device, const), kernel_cap(tf_t, dtype, device, const))

    def pair_ready(self, x, xt, cap, tf, k, m, tf_t, k_t, m_t, cap_out: bool) -> None:
        """Both blocks, just filled, made what :meth:`pair_terms` and :meth:`pair_grad` read relative to the rows'
        maxima ``m``, ``m_t``: these kernels read the raw blocks (nothing to do)."""

    def pair_held(self, x, xt, st, st_t, merged, merged_t, k, k_t) -> None:
        """Both blocks as :meth:`block_stats` left them (``st``, ``st_t``: the chunk's statistics over its
        blocks), made relative to the rows' merged ones (``merged``, ``merged_t``): nothing to do here."""

    def pair_cross(self, x, xt, tf, k, m, tf_t, k_t, m_t, dtype, const, scratch, scratch_t,
                   teacher_weighs: bool) -> torch.Tensor:
        """A KL's cross sum of one block (see :meth:`~chunked_entropy._divergence.DivergenceMath.folded`),
        offsets to the blocks' maxima ``m``, ``m_t``, weighed by the teacher (``teacher_weighs``) or the
        student: :meth:`_PairKernels.cross`."""
        kk, kk_t, cap, cap_t = self._pair_constants(tf, k, tf_t, k_t, x.shape[0], dtype, x.device, const)
        if teacher_weighs:
            return PAIR.cross(xt, x, tf_t, kk_t, m_t, tf, kk, m, dtype, cap_t, cap)
        return PAIR.cross(x, xt, tf, kk, m, tf_t, kk_t, m_t, dtype, cap, cap_t)

    def pair_terms(self, spec, x, xt, tf, k, m, ls, tf_t, k_t, m_t, ls_t, dtype, const) -> tuple:
        """One block's per-row sums ``(D, aux, parts)`` from the rows' final maxima and log-sum-exps:
        :meth:`_PairKernels.terms` (``parts`` None: the gradient reads the blocks again)."""
        kk, kk_t, cap, cap_t = self._pair_constants(tf, k, tf_t, k_t, x.shape[0], dtype, x.device, const)
        d, aux = PAIR.terms(spec.math, x, xt, tf, kk, m, ls, tf_t, kk_t, m_t, ls_t, dtype, cap, cap_t)
        return d, aux, None

    def pair_grad(self, spec, x, xt, tf, k, row, target, v0, co, tf_t, k_t, pair, scale, dtype, const, scratch,
                  cap, parts) -> torch.Tensor:
        """The gradient w.r.t. the student's raw logits of one block, written over ``x``: ``scale * dD/dx_s``
        plus, with ``co``, the student's log-prob and entropy terms (``pair``: the rows'
        :class:`~chunked_entropy._divergence.PairRows`): :meth:`_PairKernels.grad_`."""
        kk, kk_t, kcap, kcap_t = self._pair_constants(tf, k, tf_t, k_t, x.shape[0], dtype, x.device, const)
        co = co if co is not None else _stats.Coefficients(None, None, None)
        return PAIR.grad_(spec.math, x, xt, tf, kk, row, target, v0, co, tf_t, kk_t, pair.m_t, pair.ls_t,
                          pair.aux, scale, dtype, kcap, kcap_t)


class _Lazy:
    """``torch.compile`` of the functions ``functions()`` names, on first use (once, under a lock)."""

    def __init__(self, functions):
        self._lock = threading.Lock()
        self._fns = None
        self._functions = functions

    def fns(self):
        with self._lock:
            if self._fns is None:
                opts = dict(dynamic=True, fullgraph=True)
                self._fns = tuple(_no_duck_shapes(torch.compile(f, **opts)) for f in self._functions())
            return self._fns


class _Compiled(_Fast, _Lazy):
    """The compiled kernels, built on first use."""

    def __init__(self):
        super().__init__(lambda: (_stats.stats_of_block, _stats.grad_of_block, _stats.grad_of_block_))

    #: ``k`` None is taken as a tensor of ones (the compiled kernels take the multiplier as a column).
    k_optional = False

    def stats(self, z, tf, k, target, v0, want_w, want_q, dtype, out=None, merge=False, cap=None, work=None,
              scratch=None, aux=None):
        n = z.shape[0]
        kc = k_column(k, n, dtype, z.device)
        z, kk, target = _rows_of(n, z.detach(), kc, target)
        st = self.fns()[0](z, _cap_factor(tf, dtype, z.device, cap), kk, target, v0, dtype)
        keep = (True, True, True, want_w, want_q, True)
        st = _stats.BlockStats(*(t[:n] if on else None for t, on in zip(st, keep, strict=True)))
        return _into(st, out, merge, kc)

    def grad(self, z, out, tf, k, row, target, v0, co, dtype, cap=None, const=None, scratch=None, aux=None):
        """``const``: the walk's constants (:func:`kernel_k`), where the zero vectors of
        absent terms are kept once a walk and chunk size (else filled here, one a term a call)."""
        n, z_in = z.shape[0], z
        const = {} if const is None else const

        def absent(t, slot):  # zeros for an absent term: one each (no aliasing guard), kept in const
            if t is not None:
                return t
            key = ("zero", slot, n, dtype)
            if key not in const:
                const[key] = torch.zeros(n, dtype=dtype, device=z.device)
            return const[key]

        per_row = [row.m, row.ls, absent(row.ws, "ws"), absent(row.s2, "s2"), target,
                   *(absent(t, slot) for t, slot in zip(co, "cba", strict=True))]
        z, k, *per_row = _rows_of(n, z.detach(), k_column(k, n, dtype, z.device), *per_row)
        m, ls, ws, s2, target, c, b, a = per_row
        args = (_cap_factor(tf, dtype, z.device, cap), k, m, ls, ws, s2, target, v0, c, b, a, dtype)
        if n > 1 and out is z_in:  # the fused head's buffer, overwritten with its gradient
            self.fns()[2](out, *args)
            return out
        dst = out if n > 1 else out.new_empty((2,) + tuple(out.shape[1:]))
        self.fns()[1](z, dst, *args)
        return out if n > 1 else out.copy_(dst[:1])


class _PairKernels(_Fast, _Lazy):
    """A divergence's kernels (:func:`chunked_entropy._divergence.terms_of_blocks`,
    :func:`~chunked_entropy._divergence.grad_of_blocks_` and, for a KL folded online,
    :func:`~chunked_entropy._divergence.cross_of_blocks`) through ``torch.compile``, built on first use: the
    pair walk's per-block math, beside either kernels object's one-head ``stats`` (the Triton backend's
    divergence blocks run through these too: there is no hand-written divergence kernel). One compilation
    per divergence kind and ``beta`` (its value is a constant of the kernel) and dtype. Each method takes the
    heads' soft-cap factors (``cap``...) as the walk filled them once (:func:`kernel_cap`;
    None: filled here), and their multipliers as columns (the walk's once-a-walk ones)."""

    def __init__(self):
        super().__init__(lambda: (_divergence.terms_of_blocks, _divergence.grad_of_blocks_,
                                  _divergence.cross_of_blocks))

    def terms(self, math_, x, xt, tf, k, m, ls, tf_t, k_t, m_t, ls_t, dtype, cap=None, cap_t=None):
        """Per-row ``(D, aux)`` of one block of each head (raw logits, read only)."""
        n, dev = x.shape[0], x.device
        x, xt, k, k_t, m, ls, m_t, ls_t = _rows_of(n, x, xt, k_column(k, n, dtype, dev), k_column(k_t, n, dtype, dev),
                                                   m, ls, m_t, ls_t)
        d, aux = self.fns()[0](math_, x, xt, _cap_factor(tf, dtype, dev, cap), k, m, ls,
                               _cap_factor(tf_t, dtype, dev, cap_t),
                               k_t, m_t, ls_t, dtype)
        return d[:n], aux[:n]

    def cross(self, x_a, x_b, tf_a, k_a, m_a, tf_b, k_b, m_b, dtype, cap_a=None, cap_b=None):
        """A KL's cross sum of one block of each head (raw logits, read only; offsets to the blocks' maxima)."""
        n, dev = x_a.shape[0], x_a.device
        x_a, x_b, k_a, k_b, m_a, m_b = _rows_of(n, x_a, x_b, k_column(k_a, n, dtype, dev),
                                                k_column(k_b, n, dtype, dev), m_a, m_b)
        return self.fns()[2](x_a, x_b, _cap_factor(tf_a, dtype, dev, cap_a), k_a, m_a,
                             _cap_factor(tf_b, dtype, dev, cap_b), k_b,
                             m_b, dtype)[:n]

    def grad_(self, math_, x, xt, tf, k, row, target, v0, co, tf_t, k_t, m_t, ls_t, aux, scale, dtype, cap=None,
              cap_t=None):
        """The gradient w.r.t. the student's raw logits ``x`` (our buffer), written over it."""
        n, dev = x.shape[0], x.device
        zero = lambda: torch.zeros(n, dtype=dtype, device=dev)  # noqa: E731
        per_row = [row.m, row.ls, _or(row.ws, zero), target, _or(co.c, zero), _or(co.b, zero), m_t, ls_t,
                   _or(aux, zero), scale]
        z, zt, k, k_t, *per_row = _rows_of(n, x, xt, k_column(k, n, dtype, dev), k_column(k_t, n, dtype, dev),
                                           *per_row)
        m, ls, ws, target, c, b, m_t, ls_t, aux, scale = per_row
        self.fns()[1](math_, z, zt, _cap_factor(tf, dtype, dev, cap), k, m, ls, ws, target, v0, c, b,
                      _cap_factor(tf_t, dtype, dev, cap_t), k_t, m_t, ls_t, aux, scale, dtype)
        if n == 1:  # the doubled row (see _rows_of)
            x.copy_(z[:1])
        return x


#: The pair walk's divergence kernels, for every kernels object (:data:`COMPILED` and :data:`TRITON`).
PAIR = _PairKernels()


def _cap_factor(tf, dtype, device, cap=None):
    """``logit_scale / softcap`` as a 0-d tensor (a value, not a constant of the kernel), or None; ``cap``: the
    one-element tensor the caller filled once (the chunk loop's walk: :func:`kernel_cap`)."""
    if tf.softcap is None:
        return None
    if cap is not None:
        return cap.reshape(())
    # filled on the device: torch.tensor(value, device=cuda) would copy from the host (a host sync)
    return torch.full((), (tf.logit_scale or 1.0) / tf.softcap, dtype=dtype, device=device)


#: Kernels one process may need: input dtypes x compute dtypes x capped or not x the CPU reduction
#: strategy for narrow/wide blocks; above dynamo's default of 8 per function.
RECOMPILE_LIMIT = 64


def _no_duck_shapes(fn):
    """Trace without "duck sizing" (equal sizes seen at the first call, a view's base of ``chunk_size``
    rows and the chunk itself, say, must not become guards that recompile later calls), and allow
    our functions the kernels they may need (:data:`RECOMPILE_LIMIT`)."""
    from torch._dynamo import config as dynamo_config
    from torch.fx.experimental import _config as fx_config

    def call(*args):
        with fx_config.patch(use_duck_shape=False), dynamo_config.patch(recompile_limit=RECOMPILE_LIMIT):
            return fn(*args)

    return call


def _into(st: _stats.BlockStats, out, merge: bool, k) -> _stats.BlockStats:
    """A block's statistics written into ``out`` (the kernels objects' ``stats(..., out=, merge=)``: a ``[6, n]``
    tensor, rows ``m, ones, rest, w, q, zl``), merged first with the running statistics ``out`` holds
    (``merge``: :func:`chunked_entropy._stats.merge_stats`, eager); ``st`` itself without ``out``."""
    if out is None:
        return st
    fields = _stats.BlockStats(*(None if t is None else r for t, r in zip(st, out.unbind(0), strict=True)))
    if merge:
        st = _stats.merge_stats(fields, st, k)
    for dst, src in zip(fields, st, strict=True):
        if dst is not None:
            dst.copy_(src)
    return fields


def _or(t, default):
    return default() if t is None else t


def _rows_of(n: int, *tensors):
    """Per-row inputs made contiguous (an expanded upstream gradient has stride 0: another kernel), and a
    one-row block doubled (dynamo compiles a second kernel for a size-1 dim: 0/1 specialization)."""
    if n == 1:
        return tuple(torch.cat([t.detach(), t.detach()]) for t in tensors)
    return tuple(t.detach().contiguous() for t in tensors)


class _Triton(_Fast):
    """The Triton kernels (:mod:`chunked_entropy._triton`), imported on first use; same contracts as
    :class:`_Compiled`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._mod = None
        self._error = None

    def module(self):
        """The kernels' module, or None (``self._error`` says why) where Triton cannot be imported."""
        with self._lock:
            if self._mod is None and self._error is None:
                try:
                    from . import _triton
                    self._mod = _triton
                except Exception as e:  # noqa: BLE001 - not installed, or broken: the backend is unavailable
                    self._error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return self._mod

    def why_not(self, device: torch.device):
        """Why the kernels cannot run on ``device`` (an exception naming ``backend``), or None when they can."""
        mod = self.module()
        if mod is None:
            return RuntimeError(f"backend='triton' needs Triton, which cannot be imported here ({self._error}); "
                                "install it (pip install triton) or use backend='auto', 'compile' or 'eager'")
        if device.type == "cpu" and not mod.INTERPRETED and not self._as_compiled:
            return ValueError("backend='triton' runs on a CPU tensor only through Triton's interpreter: set "
                              "TRITON_INTERPRET=1 in the environment before the first backend='triton' call "
                              "(slow, for tests), or use backend='auto' or 'eager' on the CPU")
        return None

    def compiled_for(self, device: torch.device) -> bool:
        """Whether compiled (not interpreted) kernels can run on ``device``: what ``backend="auto"`` may pick."""
        return self.why_not(device) is None and (self._as_compiled or not self.module().INTERPRETED)

    #: ``k`` None is no multiplier and no tensor (the kernels' ``HAS_K`` off).
    k_optional = True

    def stats(self, z, tf, k, target, v0, want_w, want_q, dtype, out=None, merge=False, cap=None, work=None,
              scratch=None, aux=None):
        return self.module().stats(z, tf, k, target, v0, want_w, want_q, dtype, out=out, merge=merge, cap=cap)

    def grad(self, z, out, tf, k, row, target, v0, co, dtype, cap=None, const=None, scratch=None, aux=None):
        return self.module().grad(z, out, tf, k, row, target, v0, co, dtype, cap=cap)

    @contextlib.contextmanager
    def as_compiled(self):
        """Interpreted kernels taken as compiled ones (``"auto"`` may choose them) while the block is open:
        :func:`chunked_entropy.testing.cuda_branch`."""
        self._as_compiled = True
        try:
            yield
        finally:
            self._as_compiled = False

    _as_compiled = False


class _Eager(_Fast):
    """The eager kernels (:func:`chunked_entropy._stats.block_stats`, :func:`~chunked_entropy._stats.block_grad`:
    a dozen in-place PyTorch ops a block, the reference) behind the same calls as :class:`_Compiled` and
    :class:`_Triton`. They work in our buffers (``in_place``): a block's offsets written over the work buffer
    (``work``; the caller's rows read once, as ``src``, where they have its dtype and there is no soft-cap:
    :func:`_read_eager`), ``exp`` in the scratch buffer, the cap's derivative in ``aux``; they take the
    multiplier as it is and the soft-cap from the transform."""

    in_place = True
    blocks_outer = False

    def view(self, view, tf: _stats.Transform):
        """The caller's rows without a soft-cap (read once, by the first op over a block); None with one (the
        ``tanh`` is taken in our buffer)."""
        return view if tf.softcap is None else None

    def read(self, fill, view, x, into, a: int, b: int, v0: int, v1: int) -> tuple:
        """``(z, out)``: the block read into ``out`` (``into(a, b)`` when given, else ``x``), where its offsets
        and then its gradient are written; ``z`` the caller's rows where :func:`_read_eager` reads them."""
        out = x if into is None else into(a, b)
        return _read_eager(fill, view, out, a, b, v0, v1), out

    def k(self, k, n: int, dtype, device, const: dict):
        return k

    def cap(self, tf: _stats.Transform, dtype, device, const: dict):
        return None

    def stats(self, z, tf, k, target, v0, want_w, want_q, dtype, out=None, merge=False, cap=None, work=None,
              scratch=None, aux=None):
        """:func:`chunked_entropy._stats.block_stats` of ``z`` written in ``work`` (default ``z`` itself)."""
        work = z if work is None else work
        st = _stats.block_stats(work, tf, k, target, v0, scratch, want_w=want_w, want_q=want_q, aux=aux,
                                src=None if z is work else z)
        return _into(st, out, merge, k)

    def grad(self, z, out, tf, k, row, target, v0, co, dtype, cap=None, const=None, scratch=None, aux=None):
        """:func:`chunked_entropy._stats.block_grad` of ``z``, written over ``out``."""
        return _stats.block_grad(out, tf, k, row, target, v0, co, scratch, aux, src=None if z is out else z)

    def held_grad(self, z, out, scratch, aux, local, merged, tf, k, row, target, v0, co, dtype,
                  const) -> torch.Tensor:
        """From the offsets :meth:`stats` left in ``out`` (to the block's maxima), shifted to the merged ones."""
        y = _stats.shift_offsets_(out, local.m, merged.m, k) if merged is not local else out
        return _stats.grad_from_offsets_(y, tf, row, target, v0, co, scratch, aux)

    def tile_block(self, z, x) -> tuple:
        """``(x, src, compiled)`` as the invariant mode's tiles take a block: our buffer ``x`` (its offsets written
        over it), the caller's rows ``z`` read once where they are not ``x`` (``src``), the eager statistics."""
        return x, None if z is x else z, None

    def pair_ready(self, x, xt, cap, tf, k, m, tf_t, k_t, m_t, cap_out: bool) -> None:
        """Both raw blocks transformed and made offsets to ``m``, ``m_t`` in place; the student's cap derivative
        ``1 - u**2`` in ``cap`` first (``cap_out``, with a soft-cap)."""
        tf.to_u_(x)
        if cap_out and tf.softcap is not None:
            torch.mul(x, x, out=cap).neg_().add_(1.0)
        _stats.offsets_(x, m, k)
        _stats.offsets_(tf_t.to_u_(xt), m_t, k_t)

    def pair_held(self, x, xt, st, st_t, merged, merged_t, k, k_t) -> None:
        """The offsets :meth:`stats` left (to the chunk's maxima over its blocks) shifted to the merged ones."""
        if merged is not st:
            _stats.shift_offsets_(x, st.m, merged.m, k)
            _stats.shift_offsets_(xt, st_t.m, merged_t.m, k_t)

    def pair_cross(self, x, xt, tf, k, m, tf_t, k_t, m_t, dtype, const, scratch, scratch_t,
                   teacher_weighs: bool) -> torch.Tensor:
        """From the offsets :meth:`stats` left in both blocks: ``sum_j exp(y_a) (y_a - y_b)`` (``a`` the side
        that weighs), in the two scratch buffers."""
        y_a, y_b = (xt, x) if teacher_weighs else (x, xt)
        d = torch.sub(y_a, y_b, out=scratch)
        return d.mul_(torch.exp(y_a, out=scratch_t)).sum(dim=1)

    def pair_terms(self, spec, x, xt, tf, k, m, ls, tf_t, k_t, m_t, ls_t, dtype, const) -> tuple:
        """From both blocks' offsets to the final maxima: :func:`chunked_entropy._divergence.divergence_terms`
        (it overwrites them; ``parts``: what :meth:`pair_grad` may read instead)."""
        return _divergence.divergence_terms(x, xt, ls, ls_t, spec)

    def pair_grad(self, spec, x, xt, tf, k, row, target, v0, co, tf_t, k_t, pair, scale, dtype, const, scratch,
                  cap, parts) -> torch.Tensor:
        """From both blocks' offsets to the final maxima (or the ``parts`` :meth:`pair_terms` kept), written over
        ``x``; ``cap``: the student's cap derivative (:meth:`pair_ready`, or :meth:`stats`' ``aux``)."""
        if parts is not None:
            gd = _divergence.grad_from_parts(parts, x, row.ls, pair.aux, spec)
        else:
            gd = _divergence.divergence_grad(x, xt, row.ls, pair.ls_t, pair.aux, spec)
        gd.mul_(scale.unsqueeze(1))
        if co is not None and (co.c is not None or co.b is not None):
            _stats.grad_from_offsets_(x, _stats.Transform(), row, target, v0, co, scratch, None)
            x.add_(gd)
        else:
            x.copy_(gd)
        if tf.softcap is not None:
            x.mul_(cap)
        return x


COMPILED = _Compiled()
TRITON = _Triton()
EAGER = _Eager()
#: What the loop takes as its kernels (``Plan.kernels``): :data:`EAGER`, :data:`COMPILED` or :data:`TRITON`.
Kernels = Union[_Eager, _Compiled, _Triton]
#: Device types where ``backend="auto"`` tries the fast kernels (elsewhere it is eager).
AUTO_FAST = ("cuda",)
_auto = {}  # device type -> the kernels backend="auto" chose there
_auto_pair = {}  # (device type, divergence math) -> whether its kernels passed the probe there


@contextlib.contextmanager
def fast_device(device_type: str):
    """``backend="auto"`` treats ``device_type`` as :data:`AUTO_FAST` while the block is open, choosing afresh
    on entry and forgetting its choice on exit (for :func:`chunked_entropy.testing.cuda_branch`)."""
    global AUTO_FAST
    saved, saved_choice = AUTO_FAST, _auto.pop(device_type, _NONE)
    AUTO_FAST = tuple(AUTO_FAST) + (device_type,)
    try:
        yield
    finally:
        AUTO_FAST = saved
        _auto.pop(device_type, None)
        if saved_choice is not _NONE:
            _auto[device_type] = saved_choice


_NONE = object()


#: The width of the probe's wide block: several tiles of the widest tile any kernel here reads at once (the
#: multi-tile merge of every real width, and a row split across programs where the kernels split few long rows).
PROBE_WIDTH = 4 * 8192 + 37


def _probe_data(device: torch.device, dtype, n: int, width: int, seed: int):
    """A probe block: random logits of ``dtype`` with a large offset on one row and one confident row, labels at
    both ends of the block, none, and inside (``v0 = 100``: the block is not the vocabulary's first), and the
    gradient's three per-row coefficients. Made on the device (a copy from the host would wait for it)."""
    g = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(n, width, generator=g, device=device).mul_(4.0)
    z[1].add_(1000.0)  # a large logit offset (the statistics are offsets to the row's maximum)
    z[2, width // 3].add_(60.0)  # a confident row
    v0 = 100
    target = torch.full((n,), v0 + width // 2, dtype=torch.int64, device=device)
    target[0].fill_(v0)
    target[1].fill_(v0 + width - 1)
    target[2].fill_(-1)
    co = [torch.randn(n, generator=g, device=device) for _ in range(3)]
    return (z.to(dtype), target, v0, *co)


def _column(values, device: torch.device) -> torch.Tensor:
    """An ``[n, 1]`` float32 column of ``values``, filled on the device (no copy from the host)."""
    col = torch.empty(len(values), 1, device=device)
    for i, v in enumerate(values):
        col[i].fill_(v)
    return col


def _held(pairs, checks: list) -> None:
    """Append to ``checks`` one 0-d bool tensor: every ``(got, want, rtol)`` of ``pairs`` close (no read back)."""
    ok = [torch.isclose(a.float(), b.float(), rtol=r, atol=1e-5).all() for a, b, r in pairs]
    checks.append(torch.stack(ok).all())


def _probe_block(kernels, device: torch.device, dtype, checks: list) -> None:
    """Both kernels on two blocks of ``dtype``, held to the eager kernels on the same values; each block's verdict
    a 0-d bool tensor appended to ``checks`` (read by the caller, once). The wide block: several tiles a row, a
    per-row temperature (a small one among them), every statistic (the entropy's ``w`` and the ``q`` of
    ``sum_pi_squared``) and every gradient term, written into a new block. The narrow block: the soft-cap with
    a ``logit_scale``, the log-prob and entropy terms only, written over the block itself (the fused head's
    buffer). The gradient is written in ``dtype`` and compared within one rounding of it."""
    ulp = 1e-4 if dtype == torch.float32 else 2.0 ** -7  # the gradient rounded once to a bf16 (8-bit) mantissa
    cases = (
        (4, PROBE_WIDTH, _stats.Transform(), True),
        (5, 300, _stats.Transform(softcap=30.0, logit_scale=0.5), False),
    )
    for seed, (n, width, tf, wide) in enumerate(cases):
        z, target, v0, c, b, a = _probe_data(device, dtype, n, width, seed)
        if wide:  # per-row temperatures 0.7, 1.3, 0.05 and 1: k = logit_scale / t as a column
            k = _column([1 / 0.7, 1 / 1.3, 1 / 0.05, 1.0], device)
            co = _stats.Coefficients(c, b, a)
        else:
            k, co = tf.k(None), _stats.Coefficients(c, b, None)
        st = kernels.stats(z, tf, k, target, v0, True, wide, torch.float32)
        row = _stats.RowStats.from_block(st, k)
        if wide:  # into a new block
            grad = kernels.grad(z, torch.empty_like(z), tf, k, row, target, v0, co, torch.float32)
        else:  # over the block itself, as the fused head's buffer
            x = z.clone()
            grad = kernels.grad(x, x, tf, k, row, target, v0, co, torch.float32)
        zf = z.float()
        aux = torch.empty_like(zf)
        ref_st = _stats.block_stats(zf.clone(), tf, k, target, v0, torch.empty_like(zf), want_w=True, want_q=wide,
                                    aux=None)
        ref_row = _stats.RowStats.from_block(ref_st, k)
        ref_grad = _stats.block_grad(zf.clone(), tf, k, ref_row, target, v0, co, torch.empty_like(zf), aux)
        if grad.dtype != dtype:
            raise ArithmeticError(f"its gradient is {grad.dtype}, not the block's {dtype}")
        pairs = [(row.log_probs(), ref_row.log_probs(), 1e-4), (row.entropy(), ref_row.entropy(), 1e-4),
                 (grad, ref_grad.to(dtype), ulp)]
        if wide:
            pairs.append((row.sum_pi_squared(), ref_row.sum_pi_squared(), 1e-4))
        _held(pairs, checks)


def _verdict(checks: list, names: list) -> None:
    """The probe's one read: raises ArithmeticError naming the first test block whose results differ."""
    failed = [name for name, ok in zip(names, torch.stack(checks).tolist(), strict=True) if not ok]
    if failed:
        raise ArithmeticError(f"its results differ from the eager kernels' on a {failed[0]} test block")


def _warn_skip(name: str, device: torch.device, e: Exception, then: str) -> None:
    warnings.warn(
        f"chunked_entropy: backend='auto' could not run its {name} kernels on {device.type} "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); trying {then}",
        RuntimeWarning, stacklevel=5,
    )


def _probe(kernels, name: str, device: torch.device, then: str) -> bool:
    """Run both kernels on float32 blocks and bfloat16 ones (the logits and gradient dtype of most GPU runs: read
    and written in bf16; see :func:`_probe_block`) and hold their results to the eager kernels'; False (and one
    warning saying what runs ``then``) if they fail or differ: a kernel that compiles but computes wrongly on
    this device is never chosen silently. One read of the device in all (the verdict), once per device type
    and process."""
    try:
        checks, names = [], []
        for dtype in (torch.float32, torch.bfloat16):
            _probe_block(kernels, device, dtype, checks)
            names += [str(dtype)[6:]] * (len(checks) - len(names))
        _verdict(checks, names)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of the compiler means: use the next kernels
        _warn_skip(name, device, e, then)
        return False


#: The block dtypes the pair walk hands the divergence kernels (its buffers are in the compute dtype), and so
#: the ones :func:`_probe_pair` tries them on.
PAIR_PROBE_DTYPES = (torch.float32,)


def _probe_pair(math_, device: torch.device) -> bool:
    """The divergence kernels of ``math_`` (:data:`PAIR`: its per-row sums, its gradient and, for a KL, the
    cross sum folded online) on blocks as the pair walk hands them (:data:`PAIR_PROBE_DTYPES`; several tiles a
    row, a soft-capped student with per-row temperatures, a plain teacher), held to the same functions run
    eagerly; False (and one warning: that divergence then runs the eager kernels) if they fail or differ. One
    read of the device."""
    cdt = torch.float32
    try:
        checks, names = [], []
        for dtype in PAIR_PROBE_DTYPES:
            n, width = 4, PROBE_WIDTH
            z_s, target, v0, c, b, scale = _probe_data(device, dtype, n, width, 7)
            z_t = _probe_data(device, dtype, n, width, 8)[0]
            tf_s, tf_t = _stats.Transform(softcap=30.0), _stats.Transform()
            k_s = tf_s.k(_column([1 / 0.7, 1 / 1.3, 1 / 0.05, 1.0], device))
            k_t = torch.full((n, 1), 1.0 / 0.9, device=device)
            cap_s, cap_t = _cap_factor(tf_s, cdt, device), _cap_factor(tf_t, cdt, device)
            st_s = _stats.stats_of_block(z_s, cap_s, k_s, target, v0, cdt)
            st_t = _stats.stats_of_block(z_t, cap_t, k_t, target, v0, cdt)
            row = _stats.RowStats.from_block(st_s, k_s)
            ls_t = _stats.RowStats.from_block(st_t, k_t).ls
            d, aux = PAIR.terms(math_, z_s, z_t, tf_s, k_s, row.m, row.ls, tf_t, k_t, st_t.m, ls_t, cdt)
            ref_d, ref_aux = _divergence.terms_of_blocks(math_, z_s, z_t, cap_s, k_s, row.m, row.ls, cap_t, k_t,
                                                         st_t.m, ls_t, cdt)
            co = _stats.Coefficients(c, b, None)
            grad = PAIR.grad_(math_, z_s.clone(), z_t, tf_s, k_s, row, target, v0, co, tf_t, k_t, st_t.m, ls_t,
                              ref_aux, scale, cdt)
            ref_grad = z_s.clone()
            _divergence.grad_of_blocks_(math_, ref_grad, z_t, cap_s, k_s, row.m, row.ls, row.ws, target, v0, c, b,
                                        cap_t, k_t, st_t.m, ls_t, ref_aux, scale, cdt)
            ulp = 1e-4 if dtype == cdt else 2.0 ** -7  # a gradient written in bf16: one rounding of it
            pairs = [(d, ref_d, 1e-4), (aux, ref_aux, 1e-4), (grad, ref_grad, ulp)]
            if math_.weighs is not None:  # a KL: its cross sum, folded online over vocabulary blocks
                pairs.append((PAIR.cross(z_s, z_t, tf_s, k_s, st_s.m, tf_t, k_t, st_t.m, cdt),
                              _divergence.cross_of_blocks(z_s, z_t, cap_s, k_s, st_s.m, cap_t, k_t, st_t.m, cdt),
                              1e-4))
            _held(pairs, checks)
            names.append(f"{str(dtype)[6:]} divergence")
        _verdict(checks, names)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of the compiler means: the eager kernels
        _warn_skip(f"{type(math_).__name__} divergence", device, e, "the eager kernels for it")
        return False


def _choose(device: torch.device):
    """``backend="auto"``'s kernels on ``device``: Triton (compiled, not interpreted) where importable, else
    the compiled ones, each where it runs; eager (:data:`EAGER`) off :data:`AUTO_FAST` devices or where neither runs."""
    if device.type not in AUTO_FAST:
        return EAGER
    if TRITON.compiled_for(device) and _probe(TRITON, "Triton", device, "the compiled kernels"):
        return TRITON
    if _probe(COMPILED, "compiled", device, "the eager kernels"):
        return COMPILED
    return EAGER


def choose_kernels(backend: str, device: torch.device, pair=None):
    """The kernels this call runs: :data:`EAGER`, :data:`COMPILED` or :data:`TRITON`.

    ``pair``: a divergence's math (:class:`chunked_entropy._divergence.DivergenceMath`), whose own kernels
    (:data:`PAIR`) the call runs beside the chosen ones: under ``"auto"`` they are probed too, once per device
    type and divergence (:func:`_probe_pair`), and where they fail the call runs the eager kernels.

    Raises:
        RuntimeError: ``backend="triton"`` without an importable Triton.
        ValueError: ``backend="triton"`` on a CPU tensor without Triton's interpreter.
    """
    if backend == "eager":
        return EAGER
    if backend == "compile":
        return COMPILED
    if backend == "triton":
        why = TRITON.why_not(device)
        if why is not None:
            raise why
        return TRITON
    if device.type not in _auto:
        _auto[device.type] = _choose(device)
    chosen = _auto[device.type]
    if chosen is not EAGER and pair is not None:
        key = (device.type, pair)
        if key not in _auto_pair:
            _auto_pair[key] = _probe_pair(pair, device)
        if not _auto_pair[key]:
            return EAGER
    return chosen
