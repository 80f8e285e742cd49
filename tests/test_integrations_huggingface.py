"""Transformers 5, installed: ChunkedVocabParallelHead.from_hf_model against the models' own logits.

Tiny models from local configs (random weights): Qwen2 tied and untied,
Gemma 2 (``final_logit_softcapping``), Cohere (``logit_scale``) and Granite
(``logits_scaling``). The reference is the model's own forward: its logits,
``log_softmax(logits / T)``; the gradients of every parameter are compared
between the model's own path and the head's.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from chunked_entropy import ChunkedVocabParallelHead, Chunking
from tests.helpers import require

require("transformers")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transformers
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        HyperCLOVAXConfig,
        HyperCLOVAXForCausalLM,
        MptConfig,
        MptForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

assert transformers.__version__ == "5.24.0", transformers.__version__

COMMON = dict(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32)
MODELS = {
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False),
                     dict(softcap=None, logit_scale=None)),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True), dict(softcap=None, logit_scale=None)),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(final_logit_softcapping=2.0, head_dim=8),
               dict(softcap=2.0, logit_scale=None)),
    "cohere": (CohereConfig, CohereForCausalLM, dict(logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2),
               dict(softcap=None, logit_scale=0.25)),
    "granite": (GraniteConfig, GraniteForCausalLM, dict(logits_scaling=4.0), dict(softcap=None, logit_scale=0.25)),
    # multiplies by logits_scaling where Granite divides
    "hyperclovax": (HyperCLOVAXConfig, HyperCLOVAXForCausalLM, dict(logits_scaling=0.5),
                    dict(softcap=None, logit_scale=0.5)),
}
# MPT's config has a logit_scale (a number or "inv_sqrt_d_model") that its model never applies
MPT = dict(d_model=16, n_heads=2, n_layers=1, vocab_size=60, max_seq_len=32, expansion_ratio=2)
MODELS.update({
    f"mpt_{name}": (MptConfig, MptForCausalLM, dict(logit_scale=value), dict(softcap=None, logit_scale=None))
    for name, value in (("number", 0.25), ("inv_sqrt_d_model", "inv_sqrt_d_model"))
})


def _model(name, dtype=torch.float32):
    config_cls, model_cls, extra, _ = MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config_cls(**(MPT if config_cls is MptConfig else COMMON), **extra))
    with torch.no_grad():  # large enough logits that the cap and the scale matter
        model.get_output_embeddings().weight.mul_(8)
    return model.to(dtype)


def _loss_terms(g, shape):
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_equals_the_models_own_logits_values_and_every_gradient(name, temperature):
    model = _model(name)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (2, 9), generator=g)
    labels = ids[:, 1:]
    up_lp, up_h = _loss_terms(g, labels.shape)

    # the model's own path: its logits, log_softmax(logits / T)
    logits = model(input_ids=ids).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp_ref = logp.gather(-1, labels[..., None]).squeeze(-1)
    h_ref = -(logp.exp() * logp).sum(-1)
    ((lp_ref * up_lp).sum() + (h_ref * up_h).sum()).backward()

    head = ChunkedVocabParallelHead.from_hf_model(twin, chunking=Chunking(5, vocab_chunk_size=17))
    assert (head.softcap, head.logit_scale) == tuple(MODELS[name][3].values())
    assert head.weight is twin.get_output_embeddings().weight  # shared, tied or not
    hidden = twin.base_model(input_ids=ids).last_hidden_state[:, :-1]
    lp, h = head(hidden, labels, temperature=temperature)
    ((lp * up_lp).sum() + (h * up_h).sum()).backward()

    torch.testing.assert_close(lp, lp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref.detach(), rtol=1e-4, atol=1e-5)
    theirs = dict(model.named_parameters())
    for pname, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, theirs[pname].grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, pname=pname: f"{pname}: {m}")


def test_bf16_qwen2():
    model = _model("qwen2_untied", torch.bfloat16)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=ids).logits[:, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    head = ChunkedVocabParallelHead.from_hf_model(model)
    lp, _ = head(model.base_model(input_ids=ids).last_hidden_state[:, :-1], ids[:, 1:])
    torch.testing.assert_close(lp, ref, rtol=2e-2, atol=2e-2)


class _DoubledLogits(Qwen2ForCausalLM):
    """An architecture with a logit transform no config attribute announces."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_an_unknown_logit_transform_raises():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _DoubledLogits(Qwen2Config(**COMMON))
    with pytest.raises(ValueError, match="transforms its logits in a way chunked_entropy does not know"):
        ChunkedVocabParallelHead.from_hf_model(model)
    # the user can say what the transform is
    head = ChunkedVocabParallelHead.from_hf_model(model, logit_scale=2.0)
    assert head.logit_scale == 2.0


def test_not_a_causal_lm_is_a_type_error():
    with pytest.raises(TypeError, match="get_output_embeddings"):
        ChunkedVocabParallelHead.from_hf_model(torch.nn.Linear(3, 4))
