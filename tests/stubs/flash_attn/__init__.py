"""A stand-in for the ``flash_attn`` package, for importing OpenRLHF's model code on CPU only.

OpenRLHF 0.11.2's ``openrlhf.models.ring_attn_utils`` imports a few names from
flash-attn at module level; flash-attn does not install without CUDA. These
stand-ins make that import succeed and raise if anything calls them (the tests
use no packed samples and no ring attention, where OpenRLHF would). There is
deliberately no ``flash_attn.ops``: OpenRLHF's ``log_probs_from_logits`` then
takes its pure-PyTorch branch, as on any machine without flash-attn's kernels.
"""
