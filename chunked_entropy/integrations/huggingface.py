"""Hugging Face Transformers: the fused head of a causal LM, with the model's own logit transform.

:func:`head_from_model` (also ``ChunkedVocabParallelHead.from_hf_model``)
wraps a model's output embedding (tied to the input embedding or not) and
reads the transform the model applies to its logits from its config:

==============================  ===========================  ==================================
config attribute                 models                       argument
==============================  ===========================  ==================================
``final_logit_softcapping``      Gemma 2, Gemma 3             ``softcap``
``logit_scale``                  Cohere, Cohere 2             ``logit_scale``
``logits_scaling`` (a divisor)   Granite, Granite MoE         ``logit_scale = 1 / logits_scaling``
==============================  ===========================  ==================================

so that the head's log-probs equal ``log_softmax(model(...).logits / T)``.
Because a model can transform its logits in ways no table lists, the head is
checked once against the model itself: a two-token forward, comparing the
model's logits with what the head would take the softmax of. A mismatch
raises instead of returning something else.

Tested with Transformers 5.24.0 (Qwen2 tied and untied, Gemma 2, Cohere,
Granite).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["head_from_model", "logit_transform"]


def logit_transform(config) -> dict:
    """``{"softcap": ..., "logit_scale": ...}`` for a Transformers config (values None when absent)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    divisor = getattr(cfg, "logits_scaling", None)
    if divisor is not None and divisor != 1:
        if scale is not None:
            raise ValueError(f"{type(cfg).__name__} has both logit_scale and logits_scaling; which applies is unknown")
        scale = 1.0 / divisor
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
    ours = _transformed(ours, head.softcap, head.logit_scale)
    dtype = head.weight.dtype
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
    diff = (logits - ours).abs().max().item()
    scale = 1.0 + logits.abs().max().item()
    if not diff <= tol * scale:
        raise ValueError(
            f"{type(model).__name__} ({model.config.model_type}) transforms its logits in a way chunked_entropy "
            f"does not know: its logits differ from lm_head(hidden) with softcap={head.softcap}, "
            f"logit_scale={head.logit_scale} by up to {diff:.3g}. Pass softcap= and logit_scale= yourself if the "
            "transform is one of those, or compute from the model's logits with log_probs_and_entropy"
        )


def head_from_model(model, *, verify: bool = True, **kw):
    """A :class:`~chunked_entropy.ChunkedVocabParallelHead` over a Transformers causal LM's output layer.

    Args:
        model: a ``PreTrainedModel`` with an ``nn.Linear`` output embedding
            (``model.get_output_embeddings()``; tied weights are shared).
        verify: check the head against a two-token forward of the model
            (see the module doc); only disable it for a model you cannot run.
        **kw: passed to :class:`~chunked_entropy.ChunkedVocabParallelHead`
            (``chunk_size``, ``vocab_chunk_size``, ...); ``softcap`` and
            ``logit_scale`` given here override the config's.

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
