"""chunked_entropy: memory-efficient chunked log-probs and entropy, with gradients.

Public API:

- :func:`log_probs_and_entropy`: from given logits (possibly a vocabulary shard).
- :func:`linear_log_probs_and_entropy` and :class:`ChunkedVocabParallelHead`:
  from hidden states, with the lm_head matmul fused into the chunk loop.
- :class:`LogProbsEntropy`: the ``(log_probs, entropy)`` result.
"""

from .config import ChunkedEntropyConfig
from .head import ChunkedVocabParallelHead, linear_log_probs_and_entropy
from .logits import LogProbsEntropy, log_probs_and_entropy

__all__ = [
    "ChunkedEntropyConfig",
    "ChunkedVocabParallelHead",
    "LogProbsEntropy",
    "linear_log_probs_and_entropy",
    "log_probs_and_entropy",
]
__version__ = "0.1.0"
