"""verl's Megatron-actor logits processor, against the documented contract (verl is not imported).

The reference is verl's own block re-implemented here (megatron_actor.py,
``forward_step.logits_processor``): divide the logits by the temperature in
place, clone them when the entropy is needed, take the vocab-parallel entropy
of one copy and the log-probs (vocab-parallel cross entropy, which overwrites
its input) of the other, then ``masked_fill(~label_mask, 0)``. The in-place
cross entropy is replaced by a float64 log-softmax, so the reference is exact.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import ChunkedEntropyConfig
from chunked_entropy.integrations import verl
from chunked_entropy.integrations.verl import make_logits_processor
from tests.helpers import reference, run_distributed

RTOL, ATOL = 1e-5, 1e-6  # float32 computation against float64


def verl_clone_block(logits, label, label_mask, temperature, calculate_entropy):
    """verl's logits processor; ``logits`` is float64 and (like the model output) not a leaf."""
    assert logits.shape[:2] == label.shape[:2]
    assert label.shape == label_mask.shape
    if isinstance(temperature, torch.Tensor):  # verl divides by a float; a per-sample tensor the same way
        temperature = temperature.to(logits.dtype).view(-1, *([1] * (logits.dim() - 1)))
    logits.div_(temperature)
    ret = {}
    if calculate_entropy:
        logits_bak = logits.clone()
        ret["entropy"] = reference(logits, label, label_mask=label_mask)[1]  # vocab_parallel_entropy(logits)
    else:
        logits_bak = logits
    all_valid = torch.ones_like(label_mask)
    log_probs = reference(logits_bak, torch.where(label_mask, label, 0), label_mask=all_valid)[0]
    ret["log_probs"] = log_probs.masked_fill(~label_mask, 0.0)
    return ret


def verl_batch(b=3, s=9, v=37, response_length=5, seed=0):
    """Logits, labels and mask built the way verl's forward_step builds them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 3
    position_ids = torch.arange(s).expand(b, s)
    responses = torch.randint(0, v, (b, response_length), generator=g)
    attention_mask = torch.ones(b, s, dtype=torch.bool)
    attention_mask[0, -2:] = False  # a right-padded response
    label = position_ids.clone()
    label[:, -response_length - 1 : -1] = responses
    label[1, 0] = v + 40  # a position id past a tiny vocabulary: masked, so never range-checked
    label_mask = attention_mask.clone()
    label_mask[:, : -response_length - 1] = False
    label_mask[:, -1] = False
    return logits, label, label_mask


def compare(out, logits32, logits64, label, label_mask, temperature, calculate_entropy, seed=1, rtol=RTOL, atol=ATOL):
    """Values and gradients (random upstream gradients on every output) against verl's block."""
    x64 = logits64.clone().requires_grad_(True)
    ref = verl_clone_block(x64 * 1, label, label_mask, temperature, calculate_entropy)
    assert sorted(out) == sorted(ref)
    g = torch.Generator().manual_seed(seed)
    ups = {k: torch.randn(label.shape, generator=g, dtype=torch.float64) for k in sorted(ref)}
    for k in ref:
        assert out[k].shape == label.shape
        torch.testing.assert_close(out[k].double(), ref[k], rtol=rtol, atol=atol)
    sum(((out[k].double() * ups[k]).sum() for k in out)).backward()
    sum(((ref[k] * ups[k]).sum() for k in ref)).backward()
    torch.testing.assert_close(logits32.grad.double(), x64.grad, rtol=rtol * 10, atol=atol * 10)


@pytest.mark.parametrize("calculate_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_verl_block(calculate_entropy, temperature):
    logits64, label, label_mask = verl_batch()
    logits = logits64.float().requires_grad_(True)
    before = logits.detach().clone()
    version = logits._version
    processor = make_logits_processor(
        ChunkedEntropyConfig(chunk_size=4, temperature=temperature, compute_entropy=calculate_entropy)
    )
    out = processor(logits, label, label_mask)
    # The drop-in never writes its input (verl's block divides it in place and clones it).
    assert logits._version == version and torch.equal(logits.detach(), before)
    assert out["log_probs"].dtype == torch.float32
    assert torch.all(out["log_probs"][~label_mask] == 0)
    compare(out, logits, logits64, label, label_mask, temperature, calculate_entropy)


def test_per_call_overrides_and_per_sample_temperature():
    logits64, label, label_mask = verl_batch(seed=3)
    b = label.shape[0]
    processor = make_logits_processor(ChunkedEntropyConfig(chunk_size=5, compute_entropy=False, temperature=3.0))
    t = torch.tensor([0.5, 1.0, 2.0])
    logits = logits64.float().requires_grad_(True)
    out = processor(logits, label, label_mask, temperature=t, compute_entropy=True)
    compare(out, logits, logits64, label, label_mask, t, True)
    # The same per-token ([B, S]) and as [B, 1]: identical results.
    for tt in (t[:, None].expand(label.shape), t[:, None]):
        again = processor(logits.detach(), label, label_mask, temperature=tt, compute_entropy=True)
        for k in out:
            torch.testing.assert_close(again[k], out[k].detach(), rtol=0, atol=0)
    # The config's temperature and entropy switch when not overridden.
    logits.grad = None
    out = processor(logits, label, label_mask)
    assert sorted(out) == ["log_probs"]
    compare(out, logits, logits64, label, label_mask, 3.0, False)
    assert t.shape == (b,) and torch.equal(t, torch.tensor([0.5, 1.0, 2.0]))  # the caller's tensor untouched


def test_without_label_mask_and_auto_chunk():
    logits64, label, _ = verl_batch(seed=4)
    label = label % logits64.shape[-1]
    all_valid = torch.ones_like(label, dtype=torch.bool)
    # A budget of a single token's buffers: chunks of one token.
    cfg = ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=2 * 4 * logits64.shape[-1])
    assert cfg.resolve_chunk_size(logits64.shape[-1]) == 1
    logits = logits64.float().requires_grad_(True)
    out = make_logits_processor(cfg)(logits, label)
    compare(out, logits, logits64, label, all_valid, 1.0, True)


def test_bf16_logits():
    logits64, label, label_mask = verl_batch(seed=5)
    logits = logits64.bfloat16().requires_grad_(True)
    out = make_logits_processor(ChunkedEntropyConfig(chunk_size=6))(logits, label, label_mask, temperature=0.8)
    # Values: float32 math on the same bf16 inputs, so float32 tolerance against float64 of those inputs.
    exact = logits.detach().double()
    x64 = exact.clone().requires_grad_(True)
    ref = verl_clone_block(x64 * 1, label, label_mask, 0.8, True)
    for k in ref:
        torch.testing.assert_close(out[k].double(), ref[k], rtol=RTOL, atol=ATOL)
    ups = {k: torch.randn(label.shape, dtype=torch.float64) for k in ref}
    sum((out[k].double() * ups[k]).sum() for k in out).backward()
    sum((ref[k] * ups[k]).sum() for k in ref).backward()
    # The gradient is rounded to bf16 (8 bits of mantissa): relative 2**-8.
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), x64.grad, rtol=2**-8, atol=1e-3)


def test_actor_section_as_config():
    logits64, label, label_mask = verl_batch(seed=6)
    actor = {"entropy_coeff": 0.0, "clip_ratio": 0.2, "chunked_entropy": {"chunk_size": 3}}
    processor = make_logits_processor(actor)
    assert processor.config == ChunkedEntropyConfig(chunk_size=3, compute_entropy=False)
    out = processor(logits64.float(), label, label_mask)
    assert sorted(out) == ["log_probs"]
    processor = make_logits_processor(dict(actor, entropy_coeff=0.01))
    assert sorted(processor(logits64.float(), label, label_mask)) == ["entropy", "log_probs"]


def test_bad_inputs_name_the_argument():
    logits64, label, label_mask = verl_batch()
    logits = logits64.float()
    p = make_logits_processor(ChunkedEntropyConfig())
    with pytest.raises(TypeError, match="config must be"):
        make_logits_processor(1024)
    with pytest.raises(ValueError, match="process_group"):
        make_logits_processor(ChunkedEntropyConfig(), process_group=object())
    with pytest.raises(ValueError, match=r"chunked_entropy\.chunk_size"):
        make_logits_processor({"chunked_entropy": {"chunk_size": 0}})
    with pytest.raises(TypeError, match="logits must be"):
        p(logits.numpy(), label, label_mask)
    with pytest.raises(TypeError, match="label must be"):
        p(logits, label.tolist(), label_mask)
    with pytest.raises(ValueError, match="label must have the shape"):
        p(logits, label[:, 1:], label_mask)
    with pytest.raises(TypeError, match="label_mask must be a bool tensor"):
        p(logits, label, label_mask.float())
    with pytest.raises(ValueError, match="label_mask must have label's shape"):
        p(logits, label, label_mask[:, 1:])
    with pytest.raises(ValueError, match=r"temperature: a 1-D tensor .* label.shape\[0\] = 3 entries, got 2"):
        p(logits, label, label_mask, temperature=torch.ones(2))
    with pytest.raises(ValueError, match="temperature"):
        p(logits, label, label_mask, temperature=-1.0)
    with pytest.raises(TypeError, match="compute_entropy must be a bool"):
        p(logits, label, label_mask, compute_entropy=1)
    with pytest.raises(ValueError, match="labels must be vocabulary ids"):
        p(logits, torch.full_like(label, 10**6), label_mask.logical_not())


def test_default_group_is_megatrons_tp_group(tmp_path):
    # No group given: megatron-core's tensor-parallel group once model parallelism is initialized
    # (a one-process gloo world here; the TP=2 numerics are checked with an explicit group below).
    from megatron.core import parallel_state

    logits64, label, label_mask = verl_batch(seed=8)
    processor = make_logits_processor(ChunkedEntropyConfig(chunk_size=4))
    assert processor.group() is None  # not initialized: the whole vocabulary is local
    expected = processor(logits64.float(), label, label_mask)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        tp = parallel_state.get_tensor_model_parallel_group()
        assert processor.group() is tp
        explicit = make_logits_processor(processor.config, process_group=dist.group.WORLD)  # a given group wins
        assert explicit.group() is dist.group.WORLD
        out = processor(logits64.float(), label, label_mask)
        for k in expected:
            torch.testing.assert_close(out[k], expected[k], rtol=0, atol=0)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert processor.group() is None


def test_fused_helpers_reexported_lazily():
    # Importing the verl adapter does not import the Megatron helper (nor megatron-core).
    code = (
        "import sys, chunked_entropy.integrations.verl as v\n"
        "assert 'chunked_entropy.integrations.megatron' not in sys.modules\n"
        "assert 'megatron.core' not in sys.modules\n"
        "assert {'enable_fused_log_probs', 'disable_fused_log_probs'} <= set(dir(v))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    from chunked_entropy.integrations import megatron

    assert verl.enable_fused_log_probs is megatron.enable_fused_log_probs
    assert verl.disable_fused_log_probs is megatron.disable_fused_log_probs
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        verl.nope


# --- tensor parallel (gloo, TP=2) -------------------------------------------------------------


def _tp_worker(rank, world):
    logits64, label, label_mask = verl_batch(b=2, s=8, v=24, response_length=4, seed=7)
    v_local = logits64.shape[-1] // world
    group = dist.new_group(list(range(world)))
    t = torch.tensor([0.6, 1.3])
    shard = logits64[..., rank * v_local : (rank + 1) * v_local].float().requires_grad_(True)
    processor = make_logits_processor(ChunkedEntropyConfig(chunk_size=3), process_group=group)
    out = processor(shard, label, label_mask, temperature=t)
    x64 = logits64.clone().requires_grad_(True)
    ref = verl_clone_block(x64 * 1, label, label_mask, t, True)
    g = torch.Generator().manual_seed(11)  # same upstream gradients on every rank
    ups = {k: torch.randn(label.shape, generator=g, dtype=torch.float64) for k in sorted(ref)}
    assert sorted(out) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(out[k].double(), ref[k], rtol=RTOL, atol=ATOL)
    sum((out[k].double() * ups[k]).sum() for k in out).backward()
    sum((ref[k] * ups[k]).sum() for k in ref).backward()
    expected = x64.grad[..., rank * v_local : (rank + 1) * v_local]
    torch.testing.assert_close(shard.grad.double(), expected, rtol=RTOL * 10, atol=ATOL * 10)
    # Log-probs only: one fewer output, same log-probs.
    lp = processor(shard.detach(), label, label_mask, temperature=t, compute_entropy=False)
    assert sorted(lp) == ["log_probs"]
    torch.testing.assert_close(lp["log_probs"], out["log_probs"].detach(), rtol=0, atol=0)


def test_tensor_parallel_processor():
    run_distributed(_tp_worker, 2)
