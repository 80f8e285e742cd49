"""The code this library replaces, written the usual way, for the demo and the benchmark.

Nothing here is used by the library itself. These are the baselines it is
measured against:

* :func:`plain_log_probs_and_entropy`: out-of-place plain PyTorch
  (``log_softmax``, ``gather``, ``-(p * logp).sum()``); autograd keeps several
  ``[tokens, V]`` float32 tensors alive for backward.
* :func:`naive_entropy`: the entropy as verl's vocab-parallel entropy computes
  it: a custom autograd Function that saves the float32 *logits* (and the
  softmax) for its backward.
* :func:`inplace_log_probs`: the per-token log-prob as Megatron's
  ``vocab_parallel_cross_entropy`` computes it: on float32 input it overwrites
  the caller's logits with the softmax, in place (to save memory), and its
  backward turns that same buffer into the gradient.
* :func:`clone_workaround`: the stop-gap: the in-place log-prob runs on
  ``logits.clone()``, one more ``[tokens, V]`` float32 tensor.
* :func:`dense_keep_log_probs_and_entropy`: sampling replay the way slime
  does it today: a dense ``[tokens, V]`` bool keep mask, ``masked_fill`` on a
  copy of the logits, then ``log_softmax``; the entropy of the whole row.

Running :func:`naive_entropy` and then :func:`inplace_log_probs` on the *same*
logits is the seed failure: the entropy's backward finds its saved logits
modified and raises ``RuntimeError: one of the variables needed for gradient
computation has been modified by an inplace operation``.

All functions take an optional ``group``: the tensor-parallel group over which
the vocabulary is sharded (Megatron's convention), or None.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _rank_world(group):
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t, group, op=None):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


class _InplaceLogProbs(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy``, reduced to what matters here (returns -loss)."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        rank, _ = _rank_world(group)
        v = logits.shape[-1]
        x = logits.float()  # for float32 input: the caller's tensor itself
        m = x.amax(dim=-1)
        _all_reduce(m, group, dist.ReduceOp.MAX)
        x -= m.unsqueeze(-1)  # in place, as Megatron does "to reduce memory pressure"
        local = labels - rank * v
        outside = (local < 0) | (local >= v)
        local = local.masked_fill(outside, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(picked, group)
        torch.exp(x, out=x)  # in place
        s = x.sum(dim=-1)
        _all_reduce(s, group)
        x.div_(s.unsqueeze(-1))  # the caller's logits now hold the softmax
        ctx.save_for_backward(x, local, outside)
        return picked - torch.log(s)

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # in place again: d(-log p_y)/dz = softmax - onehot
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(-g.unsqueeze(-1))
        return grad, None, None


class _NaiveEntropy(torch.autograd.Function):
    """Entropy that saves the float32 logits for backward, as verl's vocab-parallel entropy does."""

    @staticmethod
    def forward(ctx, logits, group):
        x = logits.float()
        m = x.amax(dim=-1, keepdim=True)
        _all_reduce(m, group, dist.ReduceOp.MAX)
        p = (x - m).exp_()
        s = p.sum(dim=-1, keepdim=True)
        _all_reduce(s, group)
        p.div_(s)
        mu = (p * x).sum(dim=-1, keepdim=True)
        _all_reduce(mu, group)
        ctx.save_for_backward(logits, p, mu)  # <- the saved logits
        return (m + s.log() - mu).squeeze(-1)

    @staticmethod
    def backward(ctx, g):
        logits, p, mu = ctx.saved_tensors  # raises if logits were written in place since forward
        grad = (mu - logits.float()).mul_(p).mul_(g.unsqueeze(-1))
        return grad.to(logits.dtype), None


def inplace_log_probs(logits, labels, group=None):
    """Per-token log-prob, computed like Megatron's ``vocab_parallel_cross_entropy`` (negated).

    Overwrites float32 ``logits`` with the softmax, in place.
    """
    return _InplaceLogProbs.apply(logits, labels, group)


def naive_entropy(logits, group=None):
    """Per-token entropy; saves ``logits`` (and a float32 softmax) for backward."""
    return _NaiveEntropy.apply(logits, group)


def seed_failure(logits, labels, group=None):
    """The failing combination: entropy saves ``logits``, then the log-prob overwrites them."""
    entropy = naive_entropy(logits, group)
    log_probs = inplace_log_probs(logits, labels, group)
    return log_probs, entropy


def clone_workaround(logits, labels, group=None):
    """The stop-gap: the in-place log-prob gets its own copy, ``logits.clone()``."""
    entropy = naive_entropy(logits, group)
    log_probs = inplace_log_probs(logits.clone(), labels, group)
    return log_probs, entropy


def plain_log_probs_and_entropy(logits, labels):
    """Out-of-place plain PyTorch: ``log_softmax``, ``gather``, ``-(p * logp).sum()``; no vocab parallelism."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    log_probs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    return log_probs, -(p * logp).sum(dim=-1)


def dense_keep_log_probs_and_entropy(logits, labels, token_ids, offsets):
    """Log-probs over the kept sets through a dense mask (slime's route), plain torch; entropy of the whole row.

    ``token_ids`` / ``offsets`` are the kept sets in vLLM's CSR layout; the
    label counts as kept, and a row with no kept id keeps the whole row.
    """
    n, v = logits.shape
    counts = offsets.diff()
    rows = torch.repeat_interleave(torch.arange(n, device=logits.device), counts)
    keep = torch.zeros(n, v, dtype=torch.bool, device=logits.device)
    keep[rows, token_ids] = True
    keep[torch.arange(n, device=logits.device), labels] = True
    keep |= (counts == 0).unsqueeze(1)
    x = logits.float()
    kept_logp = torch.log_softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    log_probs = kept_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    logp = torch.log_softmax(x, dim=-1)
    return log_probs, -(logp.exp() * logp).sum(dim=-1)


def reference_float64(logits, labels, g_lp, g_h):
    """float64 values and gradient of ``sum(g_lp * log_prob + g_h * entropy)`` (whole vocabulary).

    Returns ``(log_probs, entropy, grad_logits)``; ``logits`` is not modified.
    """
    z = logits.detach().to(torch.float64).requires_grad_(True)
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)
    ((lp * g_lp.double()).sum() + (ent * g_h.double()).sum()).backward()
    return lp.detach(), ent.detach(), z.grad
