"""The math of a divergence between two distributions over one vocabulary: its per-token value and gradient.

A sibling of :mod:`chunked_entropy._stats` on its floor. The student's logits
``z_s`` and the teacher's ``z_t`` of one row each go through their own
:class:`~chunked_entropy._stats.Transform` and the shared temperature:

    x_s = transform_s(z_s) / t,   x_t = transform_t(z_t) / t,
    p_s = softmax(x_s),           p_t = softmax(x_t).

Each distribution's offsets ``y = x - max x``, log-sum-exp ``ls = log sum exp y``
(and, for the student, the entropy and the label's log-prob) are the ordinary
per-row statistics of :mod:`chunked_entropy._stats`, merged over vocabulary
blocks and tensor-parallel shards as there. Once both rows' ``ls`` are known,
the log-probabilities of every entry are ``lp = y - ls``, and each divergence is
a plain sum of per-entry terms over the vocabulary, so blocks and shards add
(one SUM all-reduce):

==============  ========================================  ==========================================
divergence      per-token value ``D``                     ``dD / dx_s,j``
==============  ========================================  ==========================================
forward KL      ``sum_j p_t (lp_t - lp_s)``  KL(t || s)   ``p_s,j - p_t,j``
reverse KL      ``sum_j p_s (lp_s - lp_t)``  KL(s || t)   ``p_s,j (lp_s,j - lp_t,j - D)``
JSD(beta)       ``beta KL(t || m) + (1 - beta) KL(s || m)``  ``(1 - beta) p_s,j (r_s,j - K)``
==============  ========================================  ==========================================

with the mixture ``m = (1 - beta) p_s + beta p_t`` (TRL's generalized JSD:
``beta`` -> 0 and -> 1 both make it vanish, so TRL's ``beta = 0`` and ``1`` name
the forward and the reverse KL instead), ``r_s = lp_s - log m``,
``r_t = lp_t - log m`` and ``K = KL(s || m) = sum_j p_s r_s`` (a second per-row
sum the JSD's gradient reads). The JSD's gradient has no ``log m`` term of its
own: ``sum_i (beta p_t,i + (1 - beta) p_s,i) d log m_i / dx_j = sum_i dm_i / dx_j = 0``.

**Log-ratios without cancellation.** With ``delta = lp_t - lp_s``, two forms of the same ratios,

    near (|delta| <= 1):  r_s = -log1p(beta expm1(delta)),             r_t = -log1p((1 - beta) expm1(-delta)),
    far:                  r_s = -log(1 - beta) - softplus(delta + c),   r_t = -log(beta) - softplus(-delta - c),

with ``c = log(beta / (1 - beta))``. The near form subtracts no rounded constant from a rounded logarithm:
both ratios are exactly 0 where the two log-probs are equal and keep their relative accuracy where the two are
close (a confident row's top entry, ``lp`` near 0; the far form alone lost up to 660x plain float32's accuracy
there). The far form keeps it where ``beta`` or ``1 - beta`` is small (``log1p`` of a sum near -1 would not),
and an entry where one model's probability underflows keeps an exact ratio. A teacher equal to the student
gives ``D`` and its gradient exactly 0 for every ``beta``.

The gradient w.r.t. the student's raw logits is ``dD/dx_s * kz * (1 - u**2)``
as in :mod:`chunked_entropy._stats` (``kz = logit_scale / t``; the cap's
derivative only with a soft-cap). The teacher takes no gradient.

**One class per divergence.** Each row of the table is a :class:`DivergenceMath`
subclass (:class:`ForwardKL`, :class:`ReverseKL`, :class:`JSD`) holding its
per-entry terms (``entries``, differentiable: what the sparse losses of
:mod:`chunked_entropy.losses.distill` sum), its block sums (``terms``), its
gradient from the parts the sums kept (``grad_from_parts``) and its gradient
(``grad``). Defining the subclass registers it in :data:`KINDS` under its
``kind``: a new divergence is one class, and every name list (the errors, the
ops' ``divergence=`` check, :class:`~chunked_entropy.Divergence`) reads
:data:`KINDS`. :class:`~chunked_entropy.Divergence` (``kind`` + ``beta``) is the
one object that names a divergence; :func:`check_kind` checks its two fields,
:func:`trl_kind` maps TRL's ``beta`` onto them and :func:`math_of` gives the
kind's math.

**Memory.** The functions below read the offsets blocks (never write them) and
allocate block-sized temporaries: :func:`divergence_terms` two (KL) or five
(JSD, and a bool block), of which it returns two (one for the forward KL) for
:func:`grad_from_parts`; :func:`divergence_grad` two (KL) or four (JSD); all
are freed before the next block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _stats
from ._checks import check_real

#: The divergences, by the name the ops take: each kind's class (:class:`DivergenceMath`), filled as the
#: subclasses are defined.
KINDS: dict = {}


class DivergenceMath:
    """One divergence's math: a new divergence is one subclass, registered in :data:`KINDS` by its ``kind``
    when the class is defined.

    Every method takes log-probability blocks ``lp_s``, ``lp_t`` (``[n, Vb]``, or ``[..., K]`` for
    :meth:`entries`) and sums over the last dimension:

    - :meth:`entries`: the per-entry terms whose sum is ``D`` (new tensors, differentiable: the sparse
      distillation losses of :mod:`chunked_entropy.losses.distill` sum them; an entry with ``lp = -inf``
      on the side that weighs it contributes 0);
    - :meth:`terms`: one block's per-row sums ``(D, aux, parts)``, overwriting the two blocks (ours: the
      walk's); ``aux`` the second per-row sum the gradient reads (None if none), ``parts`` what
      :meth:`grad_from_parts` makes the gradient of, once the rows' ``aux`` is complete;
    - :meth:`grad`: ``dD / dx_s`` of one block from both (a new block; the blocks are overwritten).

    ``needs_aux``: whether the gradient reads ``aux`` (summed over blocks and shards as ``D`` is).
    ``takes_beta``: whether the kind takes ``beta`` in (0, 1) (the class is then built as ``cls(beta)``).
    ``weighs``: for a KL, the side whose probabilities weigh it (``"t"`` or ``"s"``), None otherwise; such a
    divergence's value also folds online over vocabulary blocks (:meth:`folded`), in the statistics' pass.
    The methods are plain tensor code: :mod:`chunked_entropy._kernels` compiles them into the pair walk's
    kernels as they are (``backend="compile"``).
    """

    kind: ClassVar[str]
    needs_aux: ClassVar[bool] = True
    weighs: ClassVar[Optional[str]] = None
    takes_beta: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is not None:
            if kind in KINDS:
                raise ValueError(f"divergence kind {kind!r} is registered twice ({KINDS[kind].__name__}, "
                                 f"{cls.__name__})")
            KINDS[kind] = cls

    @staticmethod
    def folded(cross: torch.Tensor, s_a: torch.Tensor, ls_a: torch.Tensor, ls_b: torch.Tensor) -> torch.Tensor:
        """A KL's per-row value from its cross sum ``c = sum_j exp(y_a,j) (y_a,j - y_b,j)`` over the whole
        vocabulary (offsets to the rows' final maxima; ``a`` the side that weighs), the weighing side's sum
        ``s_a`` and both log-sum-exps: ``sum_j p_a (lp_a - lp_b) = c / s_a - ls_a + ls_b``."""
        return (cross / s_a).sub_(ls_a).add_(ls_b)

    def entries(self, lp_s: torch.Tensor, lp_t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def terms(self, lp_s: torch.Tensor, lp_t: torch.Tensor) -> tuple:
        raise NotImplementedError

    def grad_from_parts(self, parts: tuple, lp_s, aux: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def grad(self, lp_s: torch.Tensor, lp_t: torch.Tensor, aux: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def p_times(lp: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``exp(lp) * r`` per entry, 0 where ``lp = -inf`` (a new tensor, differentiable): a KL's terms."""
    return torch.where(lp == -math.inf, torch.zeros_like(r), lp.exp() * r)


class _KL(DivergenceMath):
    """What the two KLs share: ``sum_j p_a (lp_a - lp_b)``, ``a`` the side that weighs it (``weighs``), ``b``
    the other; written once, the two sides swapped."""

    def _sides(self, lp_s, lp_t) -> tuple:
        """``(lp_a, lp_b)``: the weighing side's block first."""
        return (lp_t, lp_s) if self.weighs == "t" else (lp_s, lp_t)

    def entries(self, lp_s, lp_t):
        lp_a, lp_b = self._sides(lp_s, lp_t)
        return p_times(lp_a, lp_a - lp_b)

    def _weighed_(self, lp_s, lp_t) -> tuple:
        """``(p_a (lp_a - lp_b), p_a)`` per entry, written over ``lp_b`` and ``lp_a``: :meth:`terms`' blocks."""
        lp_a, lp_b = self._sides(lp_s, lp_t)
        e = lp_b.neg_().add_(lp_a)  # lp_a - lp_b
        p_a = lp_a.exp_()
        return e.mul_(p_a), p_a


class ForwardKL(_KL):
    """``KL(t || s) = sum_j p_t (lp_t - lp_s)``; ``dD/dx_s = p_s - p_t`` (no second sum)."""

    kind = "forward_kl"
    needs_aux = False
    weighs = "t"

    def terms(self, lp_s, lp_t):
        e, p_t = self._weighed_(lp_s, lp_t)
        return e.sum(dim=1), None, (p_t,)

    def grad_from_parts(self, parts, lp_s, aux):
        return lp_s().exp_().sub_(parts[0])

    def grad(self, lp_s, lp_t, aux):
        return lp_s.exp_().sub_(lp_t.exp_())


class ReverseKL(_KL):
    """``KL(s || t) = sum_j p_s (lp_s - lp_t)``; ``dD/dx_s = p_s (lp_s - lp_t - D)`` (``aux = D``)."""

    kind = "reverse_kl"
    weighs = "s"

    def terms(self, lp_s, lp_t):
        e, p_s = self._weighed_(lp_s, lp_t)  # p_s (lp_s - lp_t), p_s
        return e.sum(dim=1), None, (e, p_s)

    def grad_from_parts(self, parts, lp_s, aux):
        e, p_s = parts
        return e.addcmul_(p_s, aux.unsqueeze(1), value=-1.0)

    def grad(self, lp_s, lp_t, aux):
        return lp_t.neg_().add_(lp_s).sub_(aux.unsqueeze(1)).mul_(lp_s.exp_())


@dataclass(frozen=True)
class JSD(DivergenceMath):
    """``beta KL(t || m) + (1 - beta) KL(s || m)``, ``m = (1 - beta) p_s + beta p_t``;
    ``dD/dx_s = (1 - beta) p_s (r_s - K)`` (``aux = K = KL(s || m)``)."""

    beta: float
    kind: ClassVar[str] = "jsd"
    takes_beta: ClassVar[bool] = True

    def entries(self, lp_s, lp_t):
        r_s, r_t = jsd_log_ratios(lp_s, lp_t, self.beta)
        return p_times(lp_t, r_t) * self.beta + p_times(lp_s, r_s) * (1.0 - self.beta)

    def terms(self, lp_s, lp_t):
        beta = self.beta
        r_s, r_t = jsd_log_ratios(lp_s, lp_t, beta)
        p_s = lp_s.exp_()
        e = r_s.mul_(p_s)  # p_s r_s
        k = e.sum(dim=1)  # KL(s || m)
        return r_t.mul_(lp_t.exp_()).sum(dim=1).mul_(beta).add_(k * (1.0 - beta)), k, (e, p_s)

    def grad_from_parts(self, parts, lp_s, aux):
        e, p_s = parts
        return e.addcmul_(p_s, aux.unsqueeze(1), value=-1.0).mul_(1.0 - self.beta)

    def grad(self, lp_s, lp_t, aux):
        r_s, _ = jsd_log_ratios(lp_s, lp_t, self.beta)
        return r_s.sub_(aux.unsqueeze(1)).mul_(lp_s.exp_()).mul_(1.0 - self.beta)


def kind_names() -> str:
    """The registered kinds, as the errors list them: ``'forward_kl', 'reverse_kl', 'jsd'``."""
    return ", ".join(map(repr, KINDS))


def check_kind(kind, beta) -> Optional[float]:
    """``beta`` checked against ``kind`` (one of :data:`KINDS`; ``beta`` in (0, 1) where the kind takes it,
    else None), as a float or None; an error naming the field otherwise."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"divergence must be one of {kind_names()}, got {kind!r}")
    if KINDS[kind].takes_beta:
        if beta is None:
            raise ValueError(f"divergence={kind!r} needs beta, the teacher's weight in the mixture, in (0, 1)")
        return check_real("beta", beta, low=0.0, high=1.0, low_open=True, high_open=True)
    if beta is not None:
        raise ValueError(
            f"beta is the JSD's mixture weight; divergence={kind!r} takes none (got beta={beta!r}). "
            "TRL's beta 0 is divergence='forward_kl', beta 1 divergence='reverse_kl'"
        )
    return None


def trl_kind(beta) -> tuple:
    """TRL's convention as ``(kind, beta)``: ``beta`` 0 the forward KL, 1 the reverse KL, in between the
    generalized JSD (the one place the two conventions meet)."""
    beta = check_real("beta", beta, low=0.0, high=1.0)
    if beta == 0.0:
        return ForwardKL.kind, None
    if beta == 1.0:
        return ReverseKL.kind, None
    return JSD.kind, beta


@functools.lru_cache(maxsize=None)
def math_of(kind: str, beta: Optional[float]) -> DivergenceMath:
    """The kind's math: one object per kind and ``beta`` in the process (the compiled kernels compile once
    per such object)."""
    cls = KINDS[kind]
    return cls(beta) if cls.takes_beta else cls()


class PairRows(NamedTuple):
    """Per-row results of the forward loop: the teacher's row max and ``log s`` (offsets units as in
    :class:`~chunked_entropy._stats.RowStats`), the divergence ``D`` and the gradient's extra sum ``aux``
    (``D`` for the reverse KL, ``K`` for the JSD, None for the forward KL)."""

    m_t: torch.Tensor
    ls_t: torch.Tensor
    div: torch.Tensor
    aux: Optional[torch.Tensor]

    def rows(self, a: int, b: int) -> "PairRows":
        return PairRows(*(None if t is None else t[a:b] for t in self))


def log_probs(y: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """``lp = y - log s``: a block's log-probabilities from its offsets to the row max (a new block)."""
    return y - ls.unsqueeze(1)


def _softplus(x: torch.Tensor, grad: bool) -> torch.Tensor:
    """``softplus(x)``: a new tensor under autograd, else written over ``x`` (one block fewer)."""
    return F.softplus(x) if grad else torch.ops.aten.softplus.out(x, 1.0, 20.0, out=x)


def jsd_log_ratios(lp_s: torch.Tensor, lp_t: torch.Tensor, beta: float):
    """``(r_s, r_t) = (lp_s - log m, lp_t - log m)`` for ``m = (1 - beta) p_s + beta p_t`` (new blocks), from
    ``delta = lp_t - lp_s``: where ``|delta| <= 1`` through ``log1p`` of ``expm1`` of it (exact 0 at equal
    entries, relative accuracy where they are close), elsewhere through one softplus each (see the module doc).

    Differentiable, with finite gradients everywhere (the near form reads ``delta`` clamped to ``[-1, 1]``).
    Outside autograd (the walks' blocks) its temporaries are reused in place: at most one block and a bool
    block beside ``delta`` and the two it returns."""
    grad = torch.is_grad_enabled() and (lp_s.requires_grad or lp_t.requires_grad)
    logit = math.log(beta) - math.log1p(-beta)
    delta = torch.sub(lp_t, lp_s)
    far = (delta > 1.0) | (delta < -1.0)
    # r_s = -log((1 - beta) + beta exp(delta))
    near = delta.clamp(-1.0, 1.0)
    near = near.expm1().mul(beta).log1p().neg() if grad else near.expm1_().mul_(beta).log1p_().neg_()
    r_s = _softplus(delta + logit, grad).neg_().sub_(math.log1p(-beta))
    r_s = torch.where(far, r_s, near, out=None if grad else r_s)
    del near
    # r_t = -log(beta + (1 - beta) exp(-delta))
    near = delta.neg().clamp(-1.0, 1.0) if grad else delta.neg().clamp_(-1.0, 1.0)
    near = near.expm1().mul(1.0 - beta).log1p().neg() if grad else near.expm1_().mul_(1.0 - beta).log1p_().neg_()
    r_t = _softplus((delta.neg() if grad else delta.neg_()).sub_(logit), grad).neg_().sub_(math.log(beta))
    return r_s, torch.where(far, r_t, near, out=None if grad else r_t)


def divergence_terms(y_s, y_t, ls_s, ls_t, divergence):
    """Per-row sums of one block, ``(D, aux, parts)``: the divergence's part on these columns, (JSD) ``K``'s,
    and the blocks :func:`grad_from_parts` makes the gradient of (a loss formed in the same pass).

    ``y_s``, ``y_t``: ``[n, Vb]`` offsets to the rows' final maxima (read only);
    ``ls_s``, ``ls_t``: ``[n]`` the rows' final ``log s``; ``divergence`` a :class:`~chunked_entropy.Divergence`.
    """
    return divergence.math.terms(log_probs(y_s, ls_s), log_probs(y_t, ls_t))


def grad_from_parts(parts: tuple, y_s, ls_s, aux: Optional[torch.Tensor], divergence) -> torch.Tensor:
    """``dD / dx_s`` of one block from what :func:`divergence_terms` kept (overwritten), once the rows' ``aux``
    is complete: ``p_s - p_t``, ``p_s (lp_s - lp_t) - p_s D`` or ``(1 - beta) (p_s r_s - p_s K)``."""
    return divergence.math.grad_from_parts(parts, lambda: log_probs(y_s, ls_s), aux)


def divergence_grad(y_s, y_t, ls_s, ls_t, aux: Optional[torch.Tensor], divergence) -> torch.Tensor:
    """``dD / dx_s`` of one ``[n, Vb]`` block (a new block), from the offsets (read only) and the rows'
    final ``log s`` and ``aux`` (see :class:`PairRows`)."""
    return divergence.math.grad(log_probs(y_s, ls_s), log_probs(y_t, ls_t), aux)


# ----------------------------------------------------------------------------- the compiled kernels' functions
#
# The pair walk's blocks through ``torch.compile`` (``backend="compile"``, :mod:`chunked_entropy._kernels`): each
# reads the two raw blocks (never writes them, but for the gradient's, which overwrites the student's block) and
# forms the transform, the offsets and the log-probs on the fly, as :func:`chunked_entropy._stats.stats_of_block`
# does for one head; the math is the kind's :class:`DivergenceMath`, as it is.


def _log_probs_of(z, cap_factor, k, m, ls, dtype):
    """``(u, y, lp)`` of a raw block: the transformed logits, the offsets to ``m`` and the log-probs."""
    u = _stats.transformed(z, cap_factor, dtype)
    y = _stats.offsets_of(u, m, k)
    return u, y, y - ls.unsqueeze(1)


def cross_of_blocks(z_a, z_b, cap_a, k_a, m_a, cap_b, k_b, m_b, dtype):
    """A KL's cross sum of one block, ``sum_j exp(y_a,j) (y_a,j - y_b,j)`` (offsets to the blocks' maxima
    ``m_a``, ``m_b``), from the raw blocks (read only): see :meth:`DivergenceMath.folded`."""
    y_a = _stats.offsets_of(_stats.transformed(z_a, cap_a, dtype), m_a, k_a)
    y_b = _stats.offsets_of(_stats.transformed(z_b, cap_b, dtype), m_b, k_b)
    return (torch.exp(y_a) * (y_a - y_b)).sum(dim=1)


def terms_of_blocks(math_: DivergenceMath, z_s, z_t, cap_s, k_s, m_s, ls_s, cap_t, k_t, m_t, ls_t, dtype):
    """Per-row sums ``(D, aux)`` of the raw blocks ``z_s``, ``z_t`` (read only), from the rows' final maxima and
    log-sum-exps (``aux`` is ``D`` where the kind keeps no second sum)."""
    _, _, lp_s = _log_probs_of(z_s, cap_s, k_s, m_s, ls_s, dtype)
    _, _, lp_t = _log_probs_of(z_t, cap_t, k_t, m_t, ls_t, dtype)
    d, aux, _ = math_.terms(lp_s, lp_t)
    return d, d if aux is None else aux


def grad_of_blocks_(math_: DivergenceMath, z_s, z_t, cap_s, k_s, m_s, ls_s, ws, target, v0: int, c, b,
                    cap_t, k_t, m_t, ls_t, aux, scale, dtype) -> None:
    """The gradient w.r.t. the student's raw logits of one block, written over ``z_s`` (a buffer of the walk):
    ``scale * dD/dx_s`` plus the student's log-prob (``c``) and entropy (``b``) terms, times the cap's derivative
    (with ``cap_s``); ``z_t`` is read only. Every per-row input is a tensor (zeros for an absent term)."""
    u, y, lp_s = _log_probs_of(z_s, cap_s, k_s, m_s, ls_s, dtype)
    _, _, lp_t = _log_probs_of(z_t, cap_t, k_t, m_t, ls_t, dtype)
    p = torch.exp(lp_s)
    col = torch.arange(u.shape[1], device=u.device).unsqueeze(0)
    # p == 0: 0, also where b * (ws - y) overflowed at a floored offset (see _stats.grad_from_offsets_)
    g = torch.where(p == 0, 0.0, p * (b.unsqueeze(1) * (ws.unsqueeze(1) - y) - c.unsqueeze(1)))
    g = g + torch.where(col == (target - v0).unsqueeze(1), c.unsqueeze(1), 0.0)
    g = g + math_.grad(lp_s, lp_t, aux) * scale.unsqueeze(1)
    if cap_s is not None:
        g = g * (1.0 - u * u)
    z_s.copy_(g)
