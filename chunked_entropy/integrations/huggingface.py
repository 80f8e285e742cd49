"""Hugging Face Transformers: the fused head of a causal LM, with the model's own logit transform.

:func:`head_from_model` (also ``ChunkedVocabParallelHead.from_hf_model``)
wraps a model's output embedding (tied to the input embedding or not) and
reads the transform the model applies to its logits from its config, for the
architectures whose code applies it (the text config's ``model_type``):

==================================  ==========================================  =====================================
config attribute                     architectures (Transformers 5.24)            argument
==================================  ==========================================  =====================================
``final_logit_softcapping``          Gemma 2/3/3n/4, VaultGemma, NanoChat, ...    ``softcap``
``logit_scale``                      Cohere, Cohere 2 (MoE), Cohere Compass       ``logit_scale``
``logits_scaling`` (a divisor)       Granite (MoE, hybrid, SWA), MiniCPM3         ``logit_scale = 1 / logits_scaling``
``logits_scaling`` (a multiplier)    HyperCLOVA X                                 ``logit_scale = logits_scaling``
==================================  ==========================================  =====================================

so that the head's log-probs equal ``log_softmax(model(...).logits / T)``.
Another architecture's attribute of the same name is not read (MPT's config
has a ``logit_scale`` its model never applies). Because a model can
transform its logits in ways no table lists, the head is checked once
against the model itself: a two-token forward, comparing the model's logits
with what the head would take the softmax of. A mismatch raises instead of
returning something else.

Tested with Transformers 5.24.0 (Qwen2 tied and untied, Gemma 2, Cohere,
Granite, HyperCLOVA X, MPT).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["head_from_model", "logit_transform"]

# The text config's model_type of each causal LM whose forward applies the attribute (read from
# Transformers 5.24.0's modeling code: ``logits / cap -> tanh -> * cap``, ``logits * logit_scale``,
# ``logits / logits_scaling`` (MiniCPM3: the hidden states, before a bias-free lm_head), ``* logits_scaling``).
SOFTCAP_MODELS = frozenset({
    "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
    "gemma4_unified_text", "vaultgemma", "nanochat", "beam", "inkling2_text", "inkling2_loop_text",
})
LOGIT_SCALE_MODELS = frozenset({"cohere", "cohere2", "cohere2_moe", "cohere_compass_text"})
DIVIDED_BY_LOGITS_SCALING = frozenset({
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "minicpm3",
})
MULTIPLIED_BY_LOGITS_SCALING = frozenset({"hyperclovax"})


def logit_transform(config) -> dict:
    """``{"softcap": ..., "logit_scale": ...}`` for a Transformers config (values None when not applied).

    Reads each attribute only for the architectures (``model_type``) whose
    causal LM applies it; see the module doc.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(cfg, "model_type", None)
    softcap = getattr(cfg, "final_logit_softcapping", None) if kind in SOFTCAP_MODELS else None
    scale = getattr(cfg, "logit_scale", None) if kind in LOGIT_SCALE_MODELS else None
    factor = getattr(cfg, "logits_scaling", None)
    if kind in DIVIDED_BY_LOGITS_SCALING and factor is not None:
        scale = 1.0 / factor
    elif kind in MULTIPLIED_BY_LOGITS_SCALING and factor is not None:
        scale = float(factor)
    return {"softcap": softcap, "logit_scale": None if scale == 1 else scale}


def _transformed(logits: torch.Tensor, softcap, logit_scale) -> torch.Tensor:
    z = logits if logit_scale is None else logits * logit_scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _verify(head, model) -> None:
    """Compare the model's logits with the head's transformed ``hidden @ W.T + b`` on a two-token probe."""
    device = head.weight.device
    probe = torch.tensor([[0, 1]], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=probe).logits.double()
            hidden = model.base_model(input_ids=probe).last_hidden_state
            ours = nn.functional.linear(hidden, head.weight, head.bias).double()
    finally:
        model.train(was_training)
    layer = head.layer
    ours = _transformed(ours, layer.softcap, layer.logit_scale)
    dtype = head.weight.dtype
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
    diff = (logits - ours).abs().max().item()
    scale = 1.0 + logits.abs().max().item()
    if not diff <= tol * scale:
        raise ValueError(
            f"{type(model).__name__} ({model.config.model_type}) transforms its logits in a way chunked_entropy "
            f"does not know: its logits differ from lm_head(hidden) with softcap={layer.softcap}, "
            f"logit_scale={layer.logit_scale} by up to {diff:.3g}. Pass softcap= and logit_scale= yourself if the "
            "transform is one of those, or compute from the model's logits with log_probs_and_entropy"
        )


def head_from_model(model, *, verify: bool = True, **kw):
    """A :class:`~chunked_entropy.ChunkedVocabParallelHead` over a Transformers causal LM's output layer.

    Args:
        model: a ``PreTrainedModel`` with an ``nn.Linear`` output embedding
            (``model.get_output_embeddings()``; tied weights are shared).
        verify: check the head against a two-token forward of the model
            (see the module doc); only disable it for a model you cannot run.
        **kw: passed to :meth:`~chunked_entropy.ChunkedVocabParallelHead.from_linear`:
            ``chunking=`` (a :class:`~chunked_entropy.Chunking` or a chunk
            size) and the :class:`~chunked_entropy.OutputLayer`'s fields
            (``logits_dtype``, ...); ``softcap`` and ``logit_scale`` given
            here override the config's.

    Returns:
        The head; its parameters are the model's (training it trains the model).

    Raises:
        TypeError: the model has no ``nn.Linear`` output embedding.
        ValueError: the model's logits are not the head's (an unknown transform).
    """
    from ..head import ChunkedVocabParallelHead

    get = getattr(model, "get_output_embeddings", None)
    lm_head = get() if callable(get) else None
    if not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"model must be a Transformers causal LM whose get_output_embeddings() is an nn.Linear, "
            f"got {type(model).__name__} with {type(lm_head).__name__}"
        )
    for key, value in logit_transform(model.config).items():
        kw.setdefault(key, value)
    head = ChunkedVocabParallelHead.from_linear(lm_head, **kw)
    if verify:
        _verify(head, model)
    return head
