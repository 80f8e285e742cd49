"""Which implementation of the per-block math runs: eager (the reference), compiled, or Triton.

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
a tiny float32 block and a bf16 one first (a failure, or results that differ
from the eager kernels', warns once and moves on to the next, down to eager);
on the CPU and other devices, eager. On a CPU tensor ``backend="triton"``
runs only through Triton's interpreter (opt-in: ``TRITON_INTERPRET=1`` in
the environment before Triton is first imported; slow, for tests).

The loop (:mod:`chunked_entropy._loop`) takes the chosen kernels as an object
with ``stats`` and ``grad`` (:data:`COMPILED`, :data:`TRITON`), or None for
eager: :func:`use_compiled`.

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
from .config import BACKENDS


def check_backend(value) -> str:
    if value not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {value!r}")
    return value


def k_column(k, n: int, dtype, device) -> torch.Tensor:
    """The per-row multiplier as an ``[n, 1]`` tensor (the compiled kernels take no float constants)."""
    if isinstance(k, torch.Tensor):
        return k
    return torch.full((n, 1), 1.0 if k is None else float(k), dtype=dtype, device=device)


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


class _Compiled(_Lazy):
    """The compiled kernels, built on first use."""

    def __init__(self):
        super().__init__(lambda: (_stats.stats_of_block, _stats.grad_of_block, _stats.grad_of_block_))

    def stats(self, z, tf, k, target, v0, want_w, want_q, dtype):
        n = z.shape[0]
        z, k, target = _rows_of(n, z.detach(), k_column(k, n, dtype, z.device), target)
        st = self.fns()[0](z, _cap_factor(tf, dtype, z.device), k, target, v0, dtype)
        keep = (True, True, True, want_w, want_q, True)
        return _stats.BlockStats(*(t[:n] if on else None for t, on in zip(st, keep, strict=True)))

    def grad(self, z, out, tf, k, row, target, v0, co, dtype):
        n, z_in = z.shape[0], z
        zero = lambda: torch.zeros(n, dtype=dtype, device=z.device)  # noqa: E731 - one each: no aliasing guard
        per_row = [row.m, row.ls, _or(row.ws, zero), _or(row.s2, zero), target, *(_or(t, zero) for t in co)]
        z, k, *per_row = _rows_of(n, z.detach(), k_column(k, n, dtype, z.device), *per_row)
        m, ls, ws, s2, target, c, b, a = per_row
        args = (_cap_factor(tf, dtype, z.device), k, m, ls, ws, s2, target, v0, c, b, a, dtype)
        if n > 1 and out is z_in:  # the fused head's buffer, overwritten with its gradient
            self.fns()[2](out, *args)
            return out
        dst = out if n > 1 else out.new_empty((2,) + tuple(out.shape[1:]))
        self.fns()[1](z, dst, *args)
        return out if n > 1 else out.copy_(dst[:1])


class _PairKernels(_Lazy):
    """A divergence's kernels (:func:`chunked_entropy._divergence.terms_of_blocks`,
    :func:`~chunked_entropy._divergence.grad_of_blocks_` and, for a KL folded online,
    :func:`~chunked_entropy._divergence.cross_of_blocks`) through ``torch.compile``, built on first use: the
    pair walk's per-block math, beside either kernels object's one-head ``stats`` (the Triton backend's
    divergence blocks run through these too: there is no hand-written divergence kernel). One compilation
    per divergence kind and ``beta`` (its value is a constant of the kernel) and dtype."""

    def __init__(self):
        super().__init__(lambda: (_divergence.terms_of_blocks, _divergence.grad_of_blocks_,
                                  _divergence.cross_of_blocks))

    def terms(self, math_, x, xt, tf, k, m, ls, tf_t, k_t, m_t, ls_t, dtype):
        """Per-row ``(D, aux)`` of one block of each head (raw logits, read only)."""
        n, dev = x.shape[0], x.device
        x, xt, k, k_t, m, ls, m_t, ls_t = _rows_of(n, x, xt, k_column(k, n, dtype, dev), k_column(k_t, n, dtype, dev),
                                                   m, ls, m_t, ls_t)
        d, aux = self.fns()[0](math_, x, xt, _cap_factor(tf, dtype, dev), k, m, ls, _cap_factor(tf_t, dtype, dev),
                               k_t, m_t, ls_t, dtype)
        return d[:n], aux[:n]

    def cross(self, x_a, x_b, tf_a, k_a, m_a, tf_b, k_b, m_b, dtype):
        """A KL's cross sum of one block of each head (raw logits, read only; offsets to the blocks' maxima)."""
        n, dev = x_a.shape[0], x_a.device
        x_a, x_b, k_a, k_b, m_a, m_b = _rows_of(n, x_a, x_b, k_column(k_a, n, dtype, dev),
                                                k_column(k_b, n, dtype, dev), m_a, m_b)
        return self.fns()[2](x_a, x_b, _cap_factor(tf_a, dtype, dev), k_a, m_a, _cap_factor(tf_b, dtype, dev), k_b,
                             m_b, dtype)[:n]

    def grad_(self, math_, x, xt, tf, k, row, target, v0, co, tf_t, k_t, m_t, ls_t, aux, scale, dtype):
        """The gradient w.r.t. the student's raw logits ``x`` (our buffer), written over it."""
        n, dev = x.shape[0], x.device
        zero = lambda: torch.zeros(n, dtype=dtype, device=dev)  # noqa: E731
        per_row = [row.m, row.ls, _or(row.ws, zero), target, _or(co.c, zero), _or(co.b, zero), m_t, ls_t,
                   _or(aux, zero), scale]
        z, zt, k, k_t, *per_row = _rows_of(n, x, xt, k_column(k, n, dtype, dev), k_column(k_t, n, dtype, dev),
                                           *per_row)
        m, ls, ws, target, c, b, m_t, ls_t, aux, scale = per_row
        self.fns()[1](math_, z, zt, _cap_factor(tf, dtype, dev), k, m, ls, ws, target, v0, c, b,
                      _cap_factor(tf_t, dtype, dev), k_t, m_t, ls_t, aux, scale, dtype)
        if n == 1:  # the doubled row (see _rows_of)
            x.copy_(z[:1])
        return x


#: The pair walk's divergence kernels, for every kernels object (:data:`COMPILED` and :data:`TRITON`).
PAIR = _PairKernels()


def _cap_factor(tf, dtype, device):
    """``logit_scale / softcap`` as a 0-d tensor (a value, not a constant of the kernel), or None."""
    if tf.softcap is None:
        return None
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


def _or(t, default):
    return default() if t is None else t


def _rows_of(n: int, *tensors):
    """Per-row inputs made contiguous (an expanded upstream gradient has stride 0: another kernel), and a
    one-row block doubled (dynamo compiles a second kernel for a size-1 dim: 0/1 specialization)."""
    if n == 1:
        return tuple(torch.cat([t.detach(), t.detach()]) for t in tensors)
    return tuple(t.detach().contiguous() for t in tensors)


class _Triton:
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

    def stats(self, z, tf, k, target, v0, want_w, want_q, dtype):
        return self.module().stats(z, tf, k, target, v0, want_w, want_q, dtype)

    def grad(self, z, out, tf, k, row, target, v0, co, dtype):
        return self.module().grad(z, out, tf, k, row, target, v0, co, dtype)

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


COMPILED = _Compiled()
TRITON = _Triton()
#: What the loop takes as ``compiled``: the kernels of a call, or None for the eager ones.
Kernels = Optional[Union[_Compiled, _Triton]]
#: Device types where ``backend="auto"`` tries the fast kernels (elsewhere it is eager).
AUTO_FAST = ("cuda",)
_auto = {}  # device type -> the kernels backend="auto" chose there (None: eager)


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


def _probe_block(kernels, device: torch.device, dtype) -> None:
    """Both kernels on a small ``[3, 300]`` block of ``dtype`` (a label at each end and none), held to the eager
    kernels on the same values; the gradient written in ``dtype``, compared within one rounding of it.
    Raises ArithmeticError where they differ."""
    g = torch.Generator(device="cpu").manual_seed(0)
    z = (torch.randn(3, 300, generator=g) * 4).to(device=device, dtype=dtype)
    target = torch.tensor([0, 299, -1], device=device)
    tf = _stats.Transform()
    co = _stats.Coefficients(torch.ones(3, device=device), torch.full((3,), 0.5, device=device), None)
    st = kernels.stats(z, tf, None, target, 0, True, False, torch.float32)
    row = _stats.RowStats.from_block(st, None)
    grad = kernels.grad(z, torch.empty_like(z), tf, None, row, target, 0, co, torch.float32)
    zf = z.float()
    ref_st = _stats.block_stats(zf.clone(), tf, None, target, 0, torch.empty_like(zf), want_w=True, want_q=False)
    ref_row = _stats.RowStats.from_block(ref_st, None)
    ref_grad = _stats.block_grad(zf.clone(), tf, None, ref_row, target, 0, co, torch.empty_like(zf), None)
    ulp = 1e-4 if dtype == torch.float32 else 2.0 ** -7  # the gradient rounded once to a bf16 (8-bit) mantissa
    pairs = [(row.log_probs(), ref_row.log_probs(), 1e-4), (row.entropy(), ref_row.entropy(), 1e-4),
             (grad.float(), ref_grad.to(dtype).float(), ulp)]
    if grad.dtype != dtype or not all(torch.allclose(a, b, rtol=r, atol=1e-5) for a, b, r in pairs):
        raise ArithmeticError(f"its results differ from the eager kernels' on a {str(dtype)[6:]} test block")


def _probe(kernels, name: str, device: torch.device, then: str) -> bool:
    """Run both kernels once on a small float32 block and a bfloat16 one (the logits and gradient dtype of most
    GPU runs: read and written in bf16) and hold their results to the eager kernels'; False (and one warning
    saying what runs ``then``) if they fail or differ: a kernel that compiles but computes wrongly on this
    device is never chosen silently."""
    try:
        for dtype in (torch.float32, torch.bfloat16):
            _probe_block(kernels, device, dtype)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of the compiler means: use the next kernels
        warnings.warn(
            f"chunked_entropy: backend='auto' could not run its {name} kernels on {device.type} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); trying {then}",
            RuntimeWarning, stacklevel=4,
        )
        return False


def _choose(device: torch.device):
    """``backend="auto"``'s kernels on ``device``: Triton (compiled, not interpreted) where importable, else
    the compiled ones, each where it runs; eager (None) off :data:`AUTO_FAST` devices or where neither runs."""
    if device.type not in AUTO_FAST:
        return None
    if TRITON.compiled_for(device) and _probe(TRITON, "Triton", device, "the compiled kernels"):
        return TRITON
    if _probe(COMPILED, "compiled", device, "the eager kernels"):
        return COMPILED
    return None


def use_compiled(backend: str, device: torch.device):
    """The kernels this call runs (:data:`COMPILED`, :data:`TRITON`), or None for the eager ones.

    Raises:
        RuntimeError: ``backend="triton"`` without an importable Triton.
        ValueError: ``backend="triton"`` on a CPU tensor without Triton's interpreter.
    """
    if backend == "eager":
        return None
    if backend == "compile":
        return COMPILED
    if backend == "triton":
        why = TRITON.why_not(device)
        if why is not None:
            raise why
        return TRITON
    if device.type not in _auto:
        _auto[device.type] = _choose(device)
    return _auto[device.type]
