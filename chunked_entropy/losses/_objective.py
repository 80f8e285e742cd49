"""The fused policy loss's objective: its per-token inputs, upstream gradients and value.

Layer: losses (below the ops). :class:`Objective` holds what the chunk loop of
:func:`~chunked_entropy.linear_policy_loss` and
:func:`~chunked_entropy.policy_loss_from_logits` reads of the loss: the
per-token gradients of the log-probs and the entropy as each chunk's statistics
are known (:meth:`Objective.token_grads`), and the loss and verl's metrics from
the outputs (:meth:`Objective.value`). Its inputs are checked when it is built,
inside the op's agreed call.
"""

from __future__ import annotations

import torch

from .._checks import check_float, require
from ..parallel import fingerprint, fingerprint_floats
from ._common import Mask, check_mask, check_same_shape
from .aggregation import aggregate
from .kl import kl_penalty, kl_penalty_grad
from .registry import check_weights, evaluate, objective
from .rollout import rollout_correction
from .token import selected

__all__ = ["Objective"]


class Objective:
    """Per-token data of the loss, its per-token upstream gradients, and its value from the outputs."""

    def __init__(self, opts, labels, old_log_probs, advantages, loss_mask, ref_log_probs,
                 rollout_is_weights, rollout_log_probs, generator, dtype):
        self.opts = opts
        self.objective = objective(opts.mode, opts.options)
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor of int64 ids, got {type(labels).__name__}")
        self.shape = labels.shape
        for name, t in (("old_log_probs", old_log_probs), ("advantages", advantages)):
            check_float(name, t)
        check_same_shape("labels", labels, old_log_probs=old_log_probs, advantages=advantages)
        check_mask(loss_mask, old_log_probs, "labels")
        if opts.kl_coef != 0 and ref_log_probs is None:
            raise ValueError("kl_coef != 0 needs ref_log_probs")
        if ref_log_probs is not None:
            check_same_shape("labels", labels, ref_log_probs=ref_log_probs)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        weights = check_weights(rollout_is_weights, old_log_probs, "old_log_probs")
        if rollout_log_probs is not None:  # verl's rollout correction, from the old and the rollout log-probs
            if weights is not None:
                raise ValueError("pass rollout_is_weights or rollout_log_probs (to compute them), not both")
            check_same_shape("labels", labels, rollout_log_probs=rollout_log_probs)
            o = opts.options
            weights, loss_mask, _ = rollout_correction(
                old_log_probs, rollout_log_probs, loss_mask, rollout_is=o.rollout_is,
                rollout_is_threshold=o.rollout_is_threshold, rollout_is_batch_normalize=o.rollout_is_batch_normalize,
                rollout_rs=o.rollout_rs, rollout_rs_threshold=o.rollout_rs_threshold)
        if self.objective.name == "bypass_mode":  # a value check of the call: part of its one host sync
            require((loss_mask != 0).any(), "loss_mode='bypass_mode' needs at least one valid token in loss_mask "
                    "(its rollout correction, as verl's, has nothing to measure otherwise)")
        self.generator = generator
        self.mask = loss_mask
        self.masks = Mask(loss_mask)  # its cast, count and aggregation weights, formed once for every use
        self.keep = self.masks.keep
        flat = lambda t: None if t is None else t.detach().reshape(-1).to(dtype)  # noqa: E731
        old, adv, ref, w = selected(self.keep.reshape(-1), flat(old_log_probs), flat(advantages), flat(ref_log_probs),
                                    flat(weights))
        self.old, self.adv, self.ref, self.is_w = old, adv, ref, w
        self.rollout = flat(rollout_log_probs)  # what the weights were computed from: agreed on by name
        self.mask_flat = loss_mask.reshape(-1)
        agg = opts.aggregation
        pg_agg = agg if self.objective.agg_mode is None else agg.with_mode(self.objective.agg_mode)
        self.weights = self.masks.aggregation(agg, dtype)[0].reshape(-1)  # the entropy's and the KL's
        self.pg_weights = self.masks.aggregation(pg_agg, dtype)[0].reshape(-1)  # the same unless the mode imposes
        self.inputs = (old_log_probs, advantages, ref_log_probs)
        self.pg = None  # (pg loss, metrics) of a sequence-level objective, from its one evaluation
        self.result = None  # (loss, metrics), set by the forward

    @property
    def span(self):
        """How many consecutive tokens a token's gradient reads (see ``loss_grad_blocks``): 1, a row's, or all."""
        if self.objective.token_local:
            return 1
        return self.shape[-1] if self.objective.reads_only_its_row(self.opts.options) else None

    def settings(self, call) -> dict:
        """What every rank of a process group must agree on beside the loss object (which the preparation
        agrees with the other objects): fingerprints of the per-token inputs; nothing without a group."""
        if call.world == 1:
            return {}
        out = {
            "old_log_probs": fingerprint_floats(self.old),
            "advantages": fingerprint_floats(self.adv),
            "ref_log_probs": fingerprint_floats(self.ref),
            "loss_mask": fingerprint_floats(self.mask_flat),
            "rollout_log_probs": fingerprint_floats(self.rollout),
            "rollout_is_weights": fingerprint_floats(self.is_w),
        }
        if self.opts.mode == "clip_cov":  # its random draw must be the same on every rank
            state = (self.generator.get_state() if self.generator is not None else torch.random.get_rng_state())
            out["the random generator's state (clip_cov draws its tokens from it)"] = fingerprint(state)
        return out

    def _pg_grad(self, a: int, b: int, lp: torch.Tensor) -> torch.Tensor:
        """The policy objective's upstream gradient of tokens ``[a, b)``: a token-local one's, from its derivative;
        any other's from autograd of the objective over the ``[B, T]`` log-probs. A row-local objective may be
        asked for whole rows: the other rows then hold the old log-probs, which no gradient of these rows reads."""
        if self.objective.token_local:
            # the derivative as written (Objective.grad), each token's from its own inputs: masked tokens hold
            # anything until token_grads selects them away, so their log-probs are not selected first
            keep = self.keep.reshape(-1)[a:b]
            g = self.objective.grad(lp, self.old[a:b], self.adv[a:b], keep, self.opts.options)
            if self.is_w is not None:
                g = g * self.is_w[a:b]
            return g * self.pg_weights[a:b]
        whole = (a, b) == (0, self.old.numel())
        x = self.old.clone()
        x[a:b] = lp.detach()
        x = x.view(self.shape).requires_grad_()
        with torch.enable_grad():
            lp_k, = selected(self.keep, x)
            loss, metrics = evaluate(self.objective, lp_k, self.old.view(self.shape), self.adv.view(self.shape),
                                     self.mask, self.opts.options, self.opts.aggregation,
                                     None if self.is_w is None else self.is_w.view(self.shape), self.generator)
            (g,) = torch.autograd.grad(loss, x, allow_unused=True)
        if whole:  # the value and metrics too; a row-local objective asked by chunks is evaluated once more at the end
            self.pg = (loss.detach(), metrics)
        return torch.zeros_like(lp) if g is None else g.reshape(-1)[a:b]

    def token_grads(self, a: int, b: int, lp: torch.Tensor):
        """Upstream gradients of ``(log_probs, entropy)`` for rows ``[a, b)`` from their log-probs (None: no
        entropy term). A sequence-level objective is asked once, for every row."""
        o, w = self.opts, self.weights[a:b]
        g = self._pg_grad(a, b, lp)
        if o.kl_coef != 0:
            g = g + o.kl_coef * kl_penalty_grad(lp, self.ref[a:b], o.kl_kind) * w
        keep = self.keep.reshape(-1)[a:b]
        g_lp = torch.where(keep, g, 0.0)
        g_h = None if o.entropy_coeff == 0 else -o.entropy_coeff * w
        return g_lp, g_h

    def finish(self, log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """Record ``(loss, metrics)`` from the chunk loop's per-token outputs; return the loss."""
        self.result = self.value(log_probs, entropy)
        return self.result[0]

    def value(self, log_probs: torch.Tensor, entropy: torch.Tensor):
        """``(loss, metrics)`` from the outputs, by the composition itself (no gradient), with verl's metric
        names: the objective's, ``"actor/pg_loss"``, ``"actor/entropy_loss"`` and, with a reference, ``"kl_loss"``."""
        o, agg = self.opts, self.opts.aggregation
        lp, ent = log_probs.view(self.shape), entropy.view(self.shape)
        if self.pg is None:
            lp_k, = selected(self.keep, lp)
            pg, metrics = evaluate(self.objective, lp_k, self.old.view(self.shape).to(lp.dtype),
                                   self.adv.view(self.shape).to(lp.dtype), self.masks, o.options, agg,
                                   None if self.is_w is None else self.is_w.view(self.shape).to(lp.dtype),
                                   self.generator)
        else:
            pg, metrics = self.pg
        entropy_loss = aggregate(ent, self.masks, agg)
        loss = pg - o.entropy_coeff * entropy_loss
        metrics = dict(metrics, **{"actor/pg_loss": pg.detach(), "actor/entropy_loss": entropy_loss.detach()})
        if self.ref is not None:
            kl = aggregate(kl_penalty(lp, self.ref.view(self.shape).to(lp.dtype), o.kl_kind), self.masks, agg)
            loss = loss + o.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss.detach(), metrics
