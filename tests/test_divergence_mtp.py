"""The MTP recipe: a megatron-core MTP layer trained by soft cross entropy against the main head's detached
next-token distribution, with :func:`chunked_entropy.linear_divergence_loss`, TP 2 over gloo on CPU.

A real megatron-core 0.16.1 ``GPTModel`` with ``mtp_num_layers=1`` (the local spec). The student is the MTP
layer's hidden states at position ``i`` (it predicts token ``i + 2``), the teacher the main trunk's at
``i + 1`` (its next token is the same ``i + 2``), detached, both through the same vocab-parallel output
weight (the teacher's side detached). Soft cross entropy ``-sum_j p_t log p_s`` is the forward KL plus the
teacher's entropy, a constant for the student: the same gradients. Checked against a float64 reference
written from the definition on the gathered weight, values and gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from chunked_entropy import OutputLayer, linear_divergence_loss  # noqa: E402
from tests.helpers import run_distributed  # noqa: E402

B, S, V, HID = 2, 8, 32, 16


@contextlib.contextmanager
def _on_cpu():
    """What cannot run on a CPU, replaced (the only replacements of this file):

    - the local spec's core attention allocates its score buffer on ``torch.cuda.current_device()``: SDPA
      computes the same causal softmax attention (the class of tests/test_integration_megatron.py);
    - the model runs in ``eval()`` mode: in training mode megatron logs its own (hard-label) MTP loss into a
      tracker allocated on ``torch.cuda.current_device()``; dropout is 0 here, so the modes compute the same;
    - megatron's ``_gather_along_last_dim`` (the MTP layer's ``eh_proj`` output gather under TP) allocates its
      output on ``torch.cuda.current_device()``: the same all-gather into a buffer on the input's device.
    """
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_last_dim

    def gather_along_last_dim(input_, group):
        world = group.size()
        if world == 1:
            return input_
        out = torch.empty((input_.shape[0] * world,) + tuple(input_.shape[1:]), dtype=input_.dtype,
                          device=input_.device)
        dist.all_gather_into_tensor(out, input_.contiguous(), group=group)
        return torch.cat(out.chunk(world, dim=0), dim=-1).contiguous()

    mappings._gather_along_last_dim = gather_along_last_dim
    try:
        yield
    finally:
        mappings._gather_along_last_dim = original


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.test_integration_megatron import _core_attention_cls

    cfg = TransformerConfig(num_layers=1, hidden_size=HID, num_attention_heads=2, tensor_model_parallel_size=2,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            mtp_num_layers=1, mtp_loss_scaling_factor=0.0)  # its own hard-label MTP loss: off
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = _core_attention_cls()
    torch.manual_seed(0)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S,
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))


def mtp_soft_cross_entropy(model, input_ids, position_ids, labels, loss_mask, *, depth=1, temperature=1.0,
                           group=None):
    """The recipe: run the model once, take the main trunk's and the MTP layer's hidden states from the MTP
    block's output, and return the soft cross entropy's loss (as :class:`~chunked_entropy.DivergenceLoss`)
    and the hidden states it read."""
    captured = {}
    hook = model.mtp.register_forward_hook(lambda module, args, out: captured.__setitem__("h", out))
    try:
        model(input_ids, position_ids, None, labels=labels, loss_mask=loss_mask)
    finally:
        hook.remove()
    h_main, *h_mtp = torch.chunk(captured["h"], 1 + model.config.mtp_num_layers, dim=0)  # [S, B, H] each
    student = h_mtp[depth - 1][:-depth]  # position i predicts token i + 1 + depth
    teacher = h_main[depth:].detach()  # position i + depth: its next token is the same one
    weight = model.output_layer.weight  # [V / tp, H], vocab-parallel; the same for both sides
    mask = loss_mask.t()[depth:].bool() if loss_mask is not None else None  # [S - depth, B], the target's mask
    loss = linear_divergence_loss(student, OutputLayer(weight, process_group=group), teacher,
                                  OutputLayer(weight.detach(), process_group=group), divergence="forward_kl",
                                  temperature=temperature, label_mask=mask, chunking=5)
    return loss, student, teacher, mask


def _case(rank):
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    model = _model().eval()  # see _on_cpu
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
    with _on_cpu():
        res, student, teacher, mask = mtp_soft_cross_entropy(model, ids, pos, labels, loss_mask, temperature=0.8,
                                                             group=group)
        weight = model.output_layer.weight
        g_student, g_weight = torch.autograd.grad(res.loss, (student, weight), retain_graph=True)
        res.loss.backward()
    # float64 reference from the definition: soft cross entropy on the gathered weight, mean over the mask
    parts = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(parts, weight.detach().contiguous())
    w64 = torch.cat(parts).double().requires_grad_()
    h64 = student.detach().double().requires_grad_()
    lp_s = torch.log_softmax(h64 @ w64.t() / 0.8, -1)
    p_t = torch.softmax(teacher.double() @ w64.detach().t() / 0.8, -1)
    soft_ce = -(p_t * lp_s).sum(-1)
    teacher_entropy = -(p_t * p_t.log()).sum(-1)
    ref = ((soft_ce - teacher_entropy) * mask).sum() / mask.sum()
    r_h, r_w = torch.autograd.grad(ref, (h64, w64))
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res.loss.double(), ref, **tol)
    torch.testing.assert_close(g_student.double(), r_h, **tol)
    vl = V // 2
    torch.testing.assert_close(g_weight.double(), r_w[rank * vl:(rank + 1) * vl], **tol)
    # the loss trains the MTP layer (and, through its input, the trunk); the teacher side took no gradient
    mtp_grads = [p.grad for p in model.mtp.parameters()]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in mtp_grads)
    assert any(gr.abs().sum() > 0 for gr in mtp_grads)
    assert not teacher.requires_grad


def _all(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        _case(rank)
    finally:
        parallel_state.destroy_model_parallel()


def test_mtp_soft_cross_entropy_tp2():
    run_distributed(_all, 2, timeout_s=120)
