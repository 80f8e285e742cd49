"""Drop-ins for RL frameworks, each a thin layer over the public functions.

- :mod:`chunked_entropy.integrations.verl`: verl's output layer, a package
  with one module per route (the Megatron engine's logits processor replaces
  the block that needed ``logits.clone()``).
- :mod:`chunked_entropy.integrations.slime` and
  :mod:`chunked_entropy.integrations.miles`: the Megatron RL trainers' log-prob
  and entropy functions (``--custom-megatron-init-path ...install``).
- :mod:`chunked_entropy.integrations.megatron`: a megatron-core ``GPTModel``
  that returns log-probs and entropy from hidden states (the fused head).
- :mod:`chunked_entropy.integrations.trl`: TRL's ``selective_log_softmax`` and
  ``entropy_from_logits``.
- :mod:`chunked_entropy.integrations.openrlhf`: OpenRLHF's
  ``log_probs_from_logits`` and ``compute_entropy``.
- :mod:`chunked_entropy.integrations.areal`: AReaL's ``gather_logprobs`` and
  ``gather_logprobs_entropy``, wherever its engines imported them
  (``install()``).
- :mod:`chunked_entropy.integrations.nemo_rl`: NeMo-RL's loss-path log-prob
  Functions, top-k distillation log-probs and entropy, without its float32
  upcast (``install()``).

Each module imports its framework lazily or not at all: importing one never
requires the framework it targets.
"""
