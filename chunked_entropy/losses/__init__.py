"""RL loss utilities: loss aggregation, policy objectives, KL penalties, entropy bonus.

Drop-in equivalents of verl 0.9.1's ``agg_loss``, policy losses and
``kl_penalty`` (``verl/trainer/ppo/core_algos.py``), with the same mode names
and formulas, for the per-token ``log_probs`` and ``entropy`` that
:func:`~chunked_entropy.log_probs_and_entropy` and
:class:`~chunked_entropy.ChunkedVocabParallelHead` return. All of them are
plain differentiable tensor expressions over ``[batch, response_length]``
tensors: nothing is saved for backward beyond what autograd keeps for these
few element-wise ops, and no ``[tokens, vocab]`` tensor is involved.

Masking: ``loss_mask`` is a bool (or 0/1, or non-negative weight) tensor of
the loss's shape. Masked positions are *selected away* (``torch.where``), not
multiplied by 0, so a NaN or inf there (padding) never reaches the loss value,
and the aggregation passes a zero gradient to every masked position. Every
mean guards its count: an all-masked batch gives a loss of 0 (with zero
gradient) instead of NaN.

The modules, one concern each: :mod:`.aggregation` (verl's agg modes and the
global-batch normalizers), :mod:`.kl` (KL estimators), :mod:`.options` (the
objectives' settings, by verl's field names), :mod:`.token` (token-local
objectives: vanilla, dppo_tv, dppo_kl, sapo, gpg, dro, cispo),
:mod:`.sequence` (objectives that read sequence or batch statistics first:
gspo, geo_mean, clip_cov, kl_cov), :mod:`.rollout` (rollout correction: IS
weights and rejection masks), :mod:`.registry` (verl's names ->
objectives, and :func:`policy_loss`) and :mod:`.distill` (distillation
divergences over K ids per token).
"""

from ._common import masked_mean
from .aggregation import AGG_MODES, Aggregation, agg_loss, agg_weights, entropy_bonus
from .distill import TopKForwardKL, sparse_divergence, topk_forward_kl, topk_overlap
from .kl import KL_KINDS, kl_penalty, kl_penalty_grad
from .policy_options import PolicyOptions
from .registry import LOSS_MODES, ROW_LOCAL_MODES, TOKEN_LOCAL_MODES, policy_loss, policy_loss_grad, row_local
from .rollout import rollout_correction

__all__ = [
    "AGG_MODES", "KL_KINDS", "LOSS_MODES", "ROW_LOCAL_MODES", "TOKEN_LOCAL_MODES", "Aggregation", "PolicyOptions",
    "agg_loss", "agg_weights", "entropy_bonus", "kl_penalty", "kl_penalty_grad", "masked_mean", "policy_loss",
    "policy_loss_grad", "rollout_correction", "row_local", "TopKForwardKL", "sparse_divergence", "topk_forward_kl",
    "topk_overlap",
]
