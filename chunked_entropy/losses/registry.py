"""verl's policy-loss names -> objectives; :func:`policy_loss`, one keyword to switch between them.

verl 0.9.1's ``POLICY_LOSS_REGISTRY`` (``verl/trainer/ppo/core_algos.py``) has
twelve names; each maps here to an :class:`Objective`:

- token-local (:mod:`.token`): the per-token loss and its derivative, so that
  the fused loss forms each token's gradient in the forward chunk loop;
- sequence- and batch-level (:mod:`.sequence`, and ``bypass_mode`` with the
  rollout correction of :mod:`.rollout`): the loss over ``[B, T]`` log-probs,
  whose autograd gives each token's upstream gradient once the log-probs it
  reads are known: its own sequence's for the row-local ones (gspo,
  geo_mean; the fused loss then walks chunks of whole rows), every token's
  for the others (the fused loss reads the whole batch's first).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Optional, Union

import torch

from .._checks import check_device, checked_call
from ._common import Mask, as_mask, check_mask, check_same_shape, check_tensor
from .aggregation import Aggregation, aggregate
from .policy_options import PolicyOptions
from .rollout import check_not_empty, check_options, correction
from .sequence import clip_cov, geo_mean, gspo, kl_cov
from .token import (
    cispo,
    cispo_grad,
    dppo_kl,
    dppo_kl_grad,
    dppo_tv,
    dppo_tv_grad,
    dro,
    dro_grad,
    gpg,
    gpg_grad,
    reinforce,
    sapo,
    sapo_grad,
    selected,
    vanilla,
    vanilla_grad,
)


class Objective(NamedTuple):
    """One of verl's policy losses.

    ``loss``: token-local objectives give ``(per-token losses, metrics)``
    (:mod:`.token`), the others ``(loss, metrics)`` over the batch
    (:mod:`.sequence`). ``grad``: the per-token derivative in ``lp`` (token-local
    only). ``agg_mode``: the aggregation the objective imposes whatever
    ``loss_agg_mode`` says (SAPO's ``"seq-mean-token-mean"``), or None.
    ``row_local``: a token's gradient reads only the log-probs of its own
    sequence (a row of ``[B, T]``): the fused loss then forms it in the
    forward chunk loop when whole rows fit a chunk. A bool, or a function of
    the options where they decide it (``bypass_mode``).
    """

    name: str
    loss: Callable
    grad: Optional[Callable] = None
    agg_mode: Optional[str] = None
    row_local: Union[bool, Callable[[PolicyOptions], bool]] = False

    @property
    def token_local(self) -> bool:
        return self.grad is not None

    def token_grad(self, lp, old, adv, loss_mask, o: PolicyOptions) -> torch.Tensor:
        """``d l / d lp`` of a token-local objective's per-token loss, written down, from selected ``[...]``
        tensors and the loss mask as a framework hands it over (bool, integer 0/1, float 0/1 or weights): the
        derivative reads only which tokens count, so ``grad`` gets ``loss_mask != 0``. Masked tokens get 0."""
        keep = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
        g = self.grad(lp, old, adv, keep, o)
        return torch.where(keep, g, 0.0)

    def reads_only_its_row(self, o: PolicyOptions) -> bool:
        """Whether, under options ``o``, a token's gradient reads only its own sequence's log-probs."""
        return self.token_local or (self.row_local(o) if callable(self.row_local) else self.row_local)


def bypass_mode(lp, old, adv, keep, o: PolicyOptions, agg, weights, generator=None):
    """verl's ``bypass_mode``: ``old`` is the rollout's log-probs; the rollout correction (IS weights and
    rejection, from the current log-probs, no gradient) then PPO's clip (``loss_type="ppo_clip"``, the IS
    weights only reported) or REINFORCE weighted by them (``"reinforce"``). ``weights`` is ignored, as verl
    ignores ``rollout_is_weights`` here."""
    w, mask, corr = correction(lp, old, keep, rollout_is=o.rollout_is, rollout_is_threshold=o.rollout_is_threshold,
                               rollout_is_batch_normalize=o.rollout_is_batch_normalize, rollout_rs=o.rollout_rs,
                               rollout_rs_threshold=o.rollout_rs_threshold)
    if o.loss_type == "reinforce":
        losses, metrics = reinforce(lp, old, adv, mask, o)
        losses = losses if w is None else losses * w
    else:
        losses, metrics = vanilla(lp, old, adv, mask, o)
    return aggregate(losses, mask, agg), {**metrics, **corr}


def _bypass_reads_only_its_row(o: PolicyOptions) -> bool:
    """bypass_mode's weights come from the current log-probs: a token's, or its sequence's (row-local), but
    batch normalization divides by every row's, and a rejection changes the mask whose count normalizes
    every row's loss."""
    return o.rollout_rs is None and not o.rollout_is_batch_normalize


OBJECTIVES = {
    o.name: o for o in (
        Objective("vanilla", vanilla, vanilla_grad),
        Objective("dppo_tv", dppo_tv, dppo_tv_grad),
        Objective("dppo_kl", dppo_kl, dppo_kl_grad),
        Objective("gspo", gspo, row_local=True),
        Objective("sapo", sapo, sapo_grad, agg_mode="seq-mean-token-mean"),
        Objective("gpg", gpg, gpg_grad),
        Objective("clip_cov", clip_cov),
        Objective("kl_cov", kl_cov),
        Objective("geo_mean", geo_mean, row_local=True),
        Objective("dro", dro, dro_grad),
        Objective("cispo", cispo, cispo_grad),
        Objective("bypass_mode", bypass_mode, row_local=_bypass_reads_only_its_row),
    )
}
LOSS_MODES = tuple(OBJECTIVES)
"""The names :func:`policy_loss` takes as ``loss_mode`` (verl 0.9.1's ``policy_loss.loss_mode`` values)."""
TOKEN_LOCAL_MODES = tuple(name for name, o in OBJECTIVES.items() if o.token_local)
"""The token-local ones: the fused losses form their gradients in the forward chunk loop (three matmul passes)."""
ROW_LOCAL_MODES = tuple(name for name, o in OBJECTIVES.items() if o.row_local is True)
"""Those that read only their own sequence's log-probs (gspo, geo_mean): formed in the forward chunk loop too
when whole rows of ``[B, T]`` fit a chunk (``chunk_size >= T``); otherwise once each row's chunks have their
statistics (all but the last then computed again). So is
``bypass_mode`` without a rejection criterion (``rollout_rs``) or batch normalization."""


def objective(loss_mode, options: PolicyOptions) -> Objective:
    """The objective named ``loss_mode``, checked against what it needs from ``options``."""
    if not isinstance(loss_mode, str) or loss_mode not in OBJECTIVES:
        raise ValueError(f"loss_mode must be one of {', '.join(map(repr, LOSS_MODES))}; got {loss_mode!r}")
    if loss_mode == "dro" and options.dro_beta is None:
        raise ValueError("loss_mode='dro' needs dro_beta (policy_loss.dro_beta in verl's config), a number > 0")
    if loss_mode == "bypass_mode":  # its rollout correction's settings (checked here, not per evaluation)
        o = options
        check_options(o.rollout_is, o.rollout_is_threshold, o.rollout_is_batch_normalize, o.rollout_rs,
                      o.rollout_rs_threshold)
    return OBJECTIVES[loss_mode]


def evaluate(obj: Objective, lp, old, adv, mask, o: PolicyOptions, agg: Aggregation, weights, generator):
    """``(loss, metrics)`` of checked, selected ``[B, T]`` tensors; differentiable in ``lp``. ``mask`` is the
    loss mask as given (bool, or weights that multiply, as in ``agg_loss`` and verl's masked means), or a
    :class:`~chunked_entropy.losses._common.Mask` of it: a token-local objective's metrics and aggregation
    then share its weights and count (the sequence- and batch-level ones take the tensor)."""
    if obj.agg_mode is not None:
        agg = agg.with_mode(obj.agg_mode)
    if obj.token_local:
        mask = as_mask(mask)
        losses, metrics = obj.loss(lp, old, adv, mask, o)
        return aggregate(losses if weights is None else losses * weights, mask, agg), metrics
    return obj.loss(lp, old, adv, mask.mask if isinstance(mask, Mask) else mask, o, agg, weights, generator)


def row_local(loss_mode: str, options: Optional[PolicyOptions] = None, **fields) -> bool:
    """Whether ``loss_mode`` under these options (verl's field names, defaults as in :func:`policy_loss`)
    gives each token a gradient that reads only its own sequence's log-probs: every token-local mode, gspo,
    geo_mean, and bypass_mode without ``rollout_rs`` or ``rollout_is_batch_normalize``. The fused loss then
    forms the gradients in its forward chunk loop (three matmul passes) when whole sequences fit a chunk."""
    o = options_of(options, fields)
    return objective(loss_mode, o).reads_only_its_row(o)


def options_of(options: Optional[PolicyOptions], fields: dict) -> PolicyOptions:
    """``options`` (or the defaults) with ``fields`` replacing its fields; an unknown field is named."""
    known = PolicyOptions.__dataclass_fields__
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"unknown policy-loss option(s) {unknown}; the options are {sorted(known)}")
    if options is None:
        return PolicyOptions(**fields)
    if not isinstance(options, PolicyOptions):
        raise TypeError(f"options must be a chunked_entropy.losses.PolicyOptions, got {type(options).__name__}")
    return options.replace(**fields) if fields else options


def check_weights(rollout_is_weights, like: torch.Tensor, like_name: str = "log_probs"):
    """``rollout_is_weights``: None, or a float tensor of the log-probs' shape (no gradient through it)."""
    if rollout_is_weights is None:
        return None
    check_tensor("rollout_is_weights", rollout_is_weights)
    if rollout_is_weights.shape != like.shape:
        raise ValueError(f"rollout_is_weights must have the log-probs' shape {tuple(like.shape)}, got "
                         f"{tuple(rollout_is_weights.shape)}")
    check_device("rollout_is_weights", rollout_is_weights, like.device, like_name)
    return rollout_is_weights.detach()


#: The flat keywords :func:`policy_loss` took before it took a ``PolicyLoss`` (kept, deprecated, until
#: :data:`FLAT_REMOVED_IN`), beside an option field by its verl name: ``loss_mode`` is the loss's ``mode``,
#: ``options`` its ``options``, the others its ``aggregation``'s fields.
FLAT_KEYWORDS = ("loss_mode", "options", "loss_agg_mode", "loss_scale_factor", "dp_size", "batch_num_tokens",
                 "global_batch_size")
FLAT_REMOVED_IN = "0.3.0"


def _flat_policy(loss_mode: str = "vanilla", loss_agg_mode: str = "token-mean",
                 loss_scale_factor: Optional[float] = None, dp_size: int = 1, batch_num_tokens=None,
                 global_batch_size=None, options: Optional[PolicyOptions] = None, **fields):
    """``(objective, options, aggregation's arguments)`` of the deprecated flat call, checked as it was."""
    o = options_of(options, fields)
    return objective(loss_mode, o), o, (loss_agg_mode, loss_scale_factor, dp_size, batch_num_tokens,
                                        global_batch_size)


def _policy_of(loss, flat: dict):
    """``(objective, options, aggregation)`` of a :func:`policy_loss` call: from ``loss`` (a
    :class:`~chunked_entropy.PolicyLoss`, or None for its defaults), or from the deprecated flat keywords
    (a ``DeprecationWarning`` naming the new form; the aggregation then as its arguments, built after the
    rollout weights are checked, as that call built it)."""
    if flat:
        if loss is not None:
            raise TypeError(f"losses.policy_loss: loss= and the flat keyword(s) {', '.join(sorted(flat))} both "
                            "given; pass the loss alone (its mode, options and aggregation)")
        warnings.warn(
            f"losses.policy_loss: the keyword(s) {', '.join(sorted(flat))} are the flat form and go in "
            f"{FLAT_REMOVED_IN}; pass loss=PolicyLoss(mode, options=..., aggregation=Aggregation(loss_agg_mode, "
            "loss_scale_factor, dp_size, batch_num_tokens, global_batch_size)) (see CHANGELOG.md)",
            DeprecationWarning, stacklevel=3)
        return _flat_policy(**flat)
    if loss is None:
        o = PolicyOptions()
        return objective("vanilla", o), o, Aggregation()
    missing = [a for a in ("mode", "options", "aggregation") if not hasattr(loss, a)]
    if missing:
        raise TypeError(f"loss must be a chunked_entropy.PolicyLoss or None, got {type(loss).__name__}")
    for name in ("entropy_coeff", "kl_coef"):
        if getattr(loss, name, 0.0) != 0.0:
            raise ValueError(
                f"losses.policy_loss is the policy objective alone: loss.{name} must be 0, got "
                f"{getattr(loss, name)!r} (add losses.entropy_bonus / losses.kl_penalty to it, or use "
                "linear_policy_loss / policy_loss_from_logits, which take the whole PolicyLoss)")
    return objective(loss.mode, loss.options), loss.options, loss.aggregation


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    loss=None,
    *,
    rollout_is_weights: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    **flat,
):
    r"""The policy loss ``loss.mode``, equal to verl 0.9.1's registered function of that name.

    ``loss`` is a :class:`~chunked_entropy.PolicyLoss`, the object the fused
    ops take: its ``mode`` (one of :data:`LOSS_MODES`), ``options`` and
    ``aggregation`` are read; its ``entropy_coeff`` and ``kl_coef`` must be 0
    (this is the objective alone). None: ``PolicyLoss()``, verl's vanilla PPO.
    The flat keywords (``loss_mode=``, ``options=``, an option by its
    verl name, ``loss_agg_mode=``, ``loss_scale_factor=``, ``dp_size=``,
    ``batch_num_tokens=``, ``global_batch_size=``; :data:`FLAT_KEYWORDS`) keep
    working, with a ``DeprecationWarning``, until 0.3.0.

    ``loss.mode`` is one of :data:`LOSS_MODES`; the formulas are on the
    :doc:`losses page </losses>` and in each objective's docstring
    (:mod:`chunked_entropy.losses.token`, :mod:`chunked_entropy.losses.sequence`).
    The options take verl's config field names and defaults
    (:class:`~chunked_entropy.losses.PolicyOptions`: ``clip_ratio``,
    ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``,
    ``tau_neg``, ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``,
    ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta``, and ``bypass_mode``'s
    ``loss_type``, ``rollout_is``, ``rollout_is_threshold``,
    ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``);
    a mode ignores the options it does not read. Take them from a verl actor
    config with ``options=PolicyOptions.from_actor_config(config.actor)``.

    Args:
        log_probs: ``[B, T]`` log-probs of the sampled tokens under the current
            policy (e.g. from :func:`~chunked_entropy.log_probs_and_entropy`);
            rows are the sequences, as in verl's padded layout.
        old_log_probs: ``[B, T]`` the same under the old policy (``bypass_mode``:
            the rollout's).
        advantages: ``[B, T]`` per-token advantages.
        loss_mask: ``[B, T]`` bool (or 0/1, or non-negative weights).
        loss: a :class:`~chunked_entropy.PolicyLoss` (``mode``, ``options``, ``aggregation``), or None.
        rollout_is_weights: ``[B, T]`` rollout-correction weights (e.g. from
            :func:`~chunked_entropy.losses.rollout_correction`), multiplied into
            every token's loss (``geo_mean``: their geometric mean per sequence;
            ``bypass_mode`` computes its own). No gradient flows through them.
            The aggregation (``loss.aggregation``, a
            :class:`~chunked_entropy.losses.Aggregation`): ``sapo`` always
            aggregates ``"seq-mean-token-mean"`` and ``geo_mean`` takes the mean
            over sequences, as in verl.
        generator: ``clip_cov``'s draw of the tokens it cuts (default: torch's
            global generator, which is what verl draws from; the same state
            selects the same tokens).
        **flat: deprecated, the flat keywords (:data:`FLAT_KEYWORDS`, and option fields by verl's names).

    Returns:
        ``(loss, metrics)``: a 0-dim loss, differentiable w.r.t. ``log_probs``,
        and verl's metrics under verl's keys (``"actor/pg_clipfrac"``,
        ``"actor/ppo_kl"``, ``"actor/pg_clipfrac_lower"`` as the mode reports
        them; ``bypass_mode`` adds its ``"rollout_corr/..."`` ones) as detached
        0-dim tensors, where verl calls ``.item()``.

    Raises:
        ValueError / TypeError: an unknown ``loss.mode`` or option, an option out
            of range (named), ``dro`` without ``dro_beta``, tensors of another
            shape, before any work.

    Differences from verl, on purpose: masked positions are selected away
    before any arithmetic (a NaN in padding never reaches the loss), an empty
    selection gives 0 where verl divides 0 by 0, and ``clip_ratio_c=None``
    turns off the dual clip (verl's ``vanilla`` always applies one).
    """
    with checked_call():  # the value checks: one host sync on an accelerator, before any work
        check_tensor("log_probs", log_probs)
        check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
        check_mask(loss_mask, log_probs, "log_probs")
        obj, o, agg = _policy_of(loss, flat)
        weights = check_weights(rollout_is_weights, log_probs)
        agg = agg if isinstance(agg, Aggregation) else Aggregation(*agg)
        agg.check_counts()
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if obj.name == "bypass_mode":
            check_not_empty(loss_mask)
    keep = loss_mask != 0
    lp, old, adv = selected(keep, log_probs, old_log_probs, advantages)
    if weights is not None:
        (weights,) = selected(keep, weights)
    return evaluate(obj, lp, old, adv, loss_mask, o, agg, weights, generator)


def policy_loss_grad(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    options: Optional[PolicyOptions] = None,
    **fields,
) -> torch.Tensor:
    """``d l / d log_probs`` of a token-local objective's per-token loss ``l``, before the IS weights and the
    aggregation, written down. Masked tokens get 0. Multiply by the IS weights and by
    :func:`~chunked_entropy.losses.agg_weights` (of the objective's aggregation) for the loss's gradient.

    Raises:
        ValueError: ``loss_mode`` is not token-local (its tokens' gradients depend on each other), or as
            :func:`policy_loss`.
    """
    with checked_call():  # the value checks: one host sync on an accelerator
        check_tensor("log_probs", log_probs)
        check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
        check_mask(loss_mask, log_probs, "log_probs")
        o = options_of(options, fields)
        obj = objective(loss_mode, o)
    if not obj.token_local:
        raise ValueError(f"loss_mode={loss_mode!r} is not token-local: a token's gradient depends on the other "
                         "tokens' log-probs; differentiate policy_loss instead")
    lp, old, adv = selected(loss_mask != 0, log_probs, old_log_probs, advantages)
    return obj.token_grad(lp, old, adv, loss_mask, o)
