"""OpenRLHF 0.11.2, installed: the drop-ins against ``openrlhf.models.utils`` and inside the real ``Actor.forward``.

OpenRLHF's model code imports flash-attn, which does not install without
CUDA; ``tests/stubs/flash_attn`` stands in for that import only (it provides
the names imported at module level, each raising if called). The model is a
tiny Qwen2 built from a local config.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings

import pytest
import torch

from chunked_entropy.integrations import openrlhf as ce_openrlhf
from tests.helpers import require

STUBS = os.path.join(os.path.dirname(__file__), "stubs")  # flash_attn's stand-in, for these imports only
sys.path.insert(0, STUBS)
try:
    require("transformers", "deepspeed", "openrlhf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import openrlhf.models.actor as openrlhf_actor
        import openrlhf.models.utils as openrlhf_utils
        from transformers import Qwen2Config, Qwen2ForCausalLM
finally:
    sys.path.remove(STUBS)
    # the stand-in must not outlive these imports: a later `import flash_attn` (verl's unpad_input, say) would find
    # it in sys.modules and take it for the real package; OpenRLHF's modules keep the names they bound
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]

assert importlib.metadata.version("openrlhf") == "0.11.2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_from_logits_matches_openrlhf(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 6, 29, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 29, (3, 6), generator=g)
    up = torch.randn(3, 6, generator=g)

    def run(fn):
        leaf = logits.clone().requires_grad_()
        x = leaf * 1  # OpenRLHF divides its input in place: give it a non-leaf
        before = x.detach().clone()
        out = fn(x, labels, temperature)
        (out.float() * up).sum().backward()
        return out, leaf.grad, torch.equal(before, x.detach())

    ours, g_ours, untouched = run(ce_openrlhf.log_probs_from_logits)
    theirs, g_theirs, theirs_untouched = run(openrlhf_utils.log_probs_from_logits)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, theirs.float(), **tol)
    torch.testing.assert_close(g_ours.float(), g_theirs.float(), **tol)
    assert untouched  # ours never writes the logits
    assert theirs_untouched == (temperature == 1.0)  # OpenRLHF's divides them in place


def test_compute_entropy_matches_openrlhf():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 33, generator=g) * 2
    up = torch.randn(2, 5, generator=g)
    grads = []
    for fn in (ce_openrlhf.compute_entropy, openrlhf_utils.compute_entropy):
        x = logits.clone().requires_grad_()
        out = fn(x)
        (out * up).sum().backward()
        grads.append((out.detach(), x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [29, -1, -100])
def test_a_label_outside_the_vocabulary_is_named(bad):
    """OpenRLHF's gather raises on any id outside [0, V), -100 included: the drop-in raises too, naming labels
    (the core alone would read -100 as an ignored token and return a log-prob of 0)."""
    logits = torch.randn(3, 6, 29)
    labels = torch.randint(0, 29, (3, 6))
    labels[1, 4] = bad
    with pytest.raises((RuntimeError, IndexError)):
        openrlhf_utils.log_probs_from_logits(logits.clone(), labels)
    with pytest.raises(ValueError, match=rf"labels must hold class ids in \[0, 29\); found {bad}"):
        ce_openrlhf.log_probs_from_logits(logits, labels)


def _actor(temperature, tmp_path):
    """OpenRLHF's Actor loading a tiny Qwen2 from a local folder, as it loads a checkpoint.

    bf16: fp32 is not offered.
    """
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "model")
    return openrlhf_actor.Actor(str(tmp_path / "model"), attn_implementation="eager", param_dtype="bf16",
                                temperature=temperature)


def _forward(actor, sequences, attention_mask, action_mask, ups):
    actor.zero_grad()
    log_probs, output = actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)
    ((log_probs * ups[0]).sum() + (output.entropy * ups[1]).sum()).backward()
    return log_probs.detach(), output.entropy.detach(), {n: p.grad.clone() for n, p in actor.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_documented_patch_of_the_real_actor(monkeypatch, tmp_path, temperature):
    """The patch on the docs page, on OpenRLHF's own Actor.forward: same log-probs, entropy and gradients."""
    actor = _actor(temperature, tmp_path)
    g = torch.Generator().manual_seed(2)
    sequences = torch.randint(0, 48, (2, 9), generator=g)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :2] = 0  # left padding
    action_mask = torch.ones(2, 4)
    ups = (torch.randn(2, 4, generator=g), torch.randn(2, 8, generator=g))
    theirs = _forward(actor, sequences, attention_mask, action_mask, ups)
    calls = []
    real = ce_openrlhf.log_probs_from_logits

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for mod in (openrlhf_actor, openrlhf_utils):  # the patch on docs/integrations/openrlhf.md
        monkeypatch.setattr(mod, "log_probs_from_logits", counted)
        monkeypatch.setattr(mod, "compute_entropy", ce_openrlhf.compute_entropy)
    ours = _forward(actor, sequences, attention_mask, action_mask, ups)
    assert calls == [1]
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    for name, grad in theirs[2].items():
        torch.testing.assert_close(ours[2][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("chunk_size", [0, 2.5, True, None])
def test_a_bad_chunk_size_is_named_chunk_size(chunk_size):
    logits, labels = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    with pytest.raises(ValueError, match=rf"^chunk_size must be an int >= 1, got {chunk_size!r}"):
        ce_openrlhf.log_probs_from_logits(logits, labels, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=rf"^chunk_size must be an int >= 1, got {chunk_size!r}"):
        ce_openrlhf.compute_entropy(logits, chunk_size=chunk_size)
