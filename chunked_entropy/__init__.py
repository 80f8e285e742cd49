"""chunked_entropy: memory-efficient chunked log-probs and entropy, with gradients.

Public API:

- :func:`log_probs_and_entropy`: from given logits (possibly a vocabulary shard).
- :func:`linear_log_probs_and_entropy` and :class:`ChunkedVocabParallelHead`:
  from hidden states, with the lm_head matmul fused into the chunk loop.
- :class:`LogProbsEntropy`: the ``(log_probs, entropy)`` result.
- :func:`linear_policy_loss` and :func:`policy_loss_from_logits`: the whole
  PPO/GRPO loss of the output layer, gradients formed in the forward pass.
- :func:`linear_divergence`, :func:`linear_divergence_loss` and
  :func:`divergence_from_logits`: forward KL, reverse KL or JSD between a
  student's and a teacher's distributions, from their hidden states.
- The settings the ops take, each built once and checked on construction:
  :class:`OutputLayer` (the weight shard, bias, logit transform, group),
  :class:`Chunking` (chunk size, vocabulary blocks, backend),
  :class:`PolicyLoss` (the RL objective) and :class:`Divergence`.
"""

from ._outputs import LogProbsEntropy
from .config import ChunkedEntropyConfig
from .divergence import (
    DivergenceLoss,
    DivergenceOutputs,
    divergence_from_logits,
    linear_divergence,
    linear_divergence_loss,
)
from .head import ChunkedVocabParallelHead
from .linear import linear_log_probs_and_entropy
from .logits import log_probs_and_entropy
from .options import Chunking, Divergence, OutputLayer, PolicyLoss
from .policy import linear_policy_loss, policy_loss_from_logits

__all__ = [
    "ChunkedEntropyConfig",
    "Chunking",
    "Divergence",
    "OutputLayer",
    "PolicyLoss",
    "ChunkedVocabParallelHead",
    "DivergenceLoss",
    "DivergenceOutputs",
    "LogProbsEntropy",
    "divergence_from_logits",
    "linear_divergence",
    "linear_divergence_loss",
    "linear_log_probs_and_entropy",
    "linear_policy_loss",
    "log_probs_and_entropy",
    "policy_loss_from_logits",
]
__version__ = "0.2.0"
