"""Against megatron-core's own vocab_parallel_cross_entropy, in a real TP=2 group on gloo.

megatron-core 0.16.1 runs on CPU here: ``initialize_model_parallel`` only needs an
initialized default process group (its groups inherit the gloo backend; the CUDA
calls sit behind SHARP / UCC options we do not use), and
``vocab_parallel_cross_entropy`` is plain torch plus all-reduces on the TP group.

Also reproduces the seed failure: on float32 logits Megatron's cross entropy
overwrites its input with the softmax, so an entropy computed by ordinary
autograd ops on the same logits cannot backward; our function on the same
logits can, with the exact gradient.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

# Skip without megatron-core, but do not import it here: the import costs seconds
# and only the spawned ranks need it (a plain importorskip would pay it twice).
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install '.[megatron]')", allow_module_level=True)

from chunked_entropy import OutputLayer
from tests.helpers import reference, run_distributed  # noqa: E402

VAL = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-5, atol=1e-6)


def _torch_entropy(logits):
    """verl's entropy_from_logits: ordinary autograd ops that save ``logits`` itself."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def _worker(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from chunked_entropy import log_probs_and_entropy
    from chunked_entropy.parallel import default_tp_group

    parallel_state.initialize_model_parallel(2)
    try:
        tp = parallel_state.get_tensor_model_parallel_group()
        assert parallel_state.get_tensor_model_parallel_world_size() == 2
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        assert default_tp_group() is tp

        g = torch.Generator().manual_seed(0)  # the same data on both ranks
        s, b, v_local = 7, 3, 11
        v = 2 * v_local
        full = torch.randn(s, b, v, generator=g, dtype=torch.float64) * 3
        target = torch.randint(0, v, (s, b), generator=g)
        target.view(-1)[:4] = torch.tensor([0, v_local - 1, v_local, v - 1])  # shard edges
        g_up = torch.randn(s, b, generator=g, dtype=torch.float64)
        g_h = torch.randn(s, b, generator=g, dtype=torch.float64)
        shard = full[..., tp_rank * v_local : (tp_rank + 1) * v_local].float()
        ref_slice = slice(tp_rank * v_local, (tp_rank + 1) * v_local)

        # 1. same log-probs and log-prob gradients as Megatron (fed a clone)
        for chunk in (1, 4, 100):
            x_m = shard.clone().requires_grad_(True)
            lp_m = -vocab_parallel_cross_entropy(x_m.clone(), target)
            (lp_m * g_up.float()).sum().backward()

            x_o = shard.clone().requires_grad_(True)
            lp_o, _ = log_probs_and_entropy(x_o, target, layer=OutputLayer(process_group=tp), chunking=chunk)
            (lp_o * g_up.float()).sum().backward()

            torch.testing.assert_close(lp_o, lp_m, **VAL)
            torch.testing.assert_close(x_o.grad, x_m.grad, **GRAD)
            lp_ref, _ = reference(full, target)
            torch.testing.assert_close(lp_o.double(), lp_ref, **VAL)

        # bf16 logits (Megatron upcasts a copy; we cast per chunk): same log-probs, and
        # gradients that each went through one rounding to bf16 (half an ulp, 2**-9
        # relative, each), so they differ by at most one ulp, 2**-8; we allow 2**-7.
        x_m = shard.bfloat16().requires_grad_(True)
        lp_m = -vocab_parallel_cross_entropy(x_m, target)
        (lp_m * g_up.float()).sum().backward()
        x_o = shard.bfloat16().requires_grad_(True)
        lp_o, _ = log_probs_and_entropy(x_o, target, layer=OutputLayer(process_group=tp), chunking=5)
        (lp_o * g_up.float()).sum().backward()
        torch.testing.assert_close(lp_o, lp_m, **VAL)
        assert x_o.grad.dtype == torch.bfloat16
        torch.testing.assert_close(x_o.grad.float(), x_m.grad.float(), rtol=2**-7, atol=1e-6)

        # 2. the seed failure is real: Megatron's CE writes the softmax into float32
        #    logits that the entropy's ops saved, and backward refuses
        x = shard.clone().requires_grad_(True)
        logits = x * 1.0  # a model's output: a non-leaf float32 tensor
        entropy = _torch_entropy(logits)  # (local-shard entropy: enough to save logits)
        before = logits.detach().clone()
        lp_m = -vocab_parallel_cross_entropy(logits, target)
        assert not torch.equal(logits.detach(), before)  # overwritten in place
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            ((lp_m * g_up.float()).sum() + (entropy * g_h.float()).sum()).backward()

        # 3. the same composition with our function instead: no clone, exact gradient
        x = shard.clone().requires_grad_(True)
        logits = x * 1.0
        entropy = _torch_entropy(logits)
        version = logits._version
        lp_o, ent_o = log_probs_and_entropy(logits, target, layer=OutputLayer(process_group=tp), chunking=4)
        assert logits._version == version and torch.equal(logits.detach(), shard)
        (
            (lp_o * g_up.float()).sum() + (entropy * g_h.float()).sum() + (ent_o * g_h.float()).sum()
        ).backward()

        xr = full.clone().requires_grad_(True)
        lp_ref, ent_ref = reference(xr, target)
        shard_r = xr[..., ref_slice]
        local_ent = _torch_entropy(shard_r)
        ((lp_ref * g_up).sum() + (local_ent * g_h).sum() + (ent_ref * g_h).sum()).backward()
        torch.testing.assert_close(lp_o.double(), lp_ref.detach(), **VAL)
        torch.testing.assert_close(ent_o.double(), ent_ref.detach(), **VAL)
        torch.testing.assert_close(x.grad.double(), xr.grad[..., ref_slice], **GRAD)
    finally:
        parallel_state.destroy_model_parallel()


def test_matches_megatron_vocab_parallel_cross_entropy_and_fixes_the_seed_failure():
    run_distributed(_worker, 2)
