"""Distillation divergences on ``[..., K]`` tensors against verl 0.9.1's and TRL 1.16's installed functions.

verl's ``compute_forward_kl_topk`` (the FSDP route: a full log-softmax of the
student's logits, the teacher's top-k as jagged tensors) and TRL's sparse
generalized JSD with its tail bucket (``trl.experimental.server_distillation``)
are the references, on the same inputs; values and the student's gradients.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from chunked_entropy import Divergence, losses
from tests.helpers import require

require("verl", "trl")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.server_distillation.server_distillation_trainer import _add_tail_bucket, _jsd_divergence
    from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk
    from verl.workers.config.distillation import DistillationLossConfig


class _Config:
    """verl's ``DistillationConfig`` holds the loss config as ``.distillation_loss``; the function reads only that."""

    def __init__(self, clamp):
        self.distillation_loss = DistillationLossConfig(loss_mode="forward_kl_topk", log_prob_min_clamp=clamp)


def _case(seed, n=11, v=40, k=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, n, v, generator=g, dtype=torch.float64) * 3
    teacher_logits = logits + torch.randn(1, n, v, generator=g, dtype=torch.float64)
    t_lp, t_ids = torch.log_softmax(teacher_logits, -1).topk(k, dim=-1)
    return logits, t_lp, t_ids


@pytest.mark.parametrize("clamp", [None, -10.0, -3.0])
def test_topk_forward_kl_and_overlap_are_verls(clamp):
    logits, t_lp, t_ids = _case(0)
    x = logits.clone().requires_grad_()
    nested = lambda t: torch.nested.nested_tensor([t[0, :5], t[0, 5:]], layout=torch.jagged)  # noqa: E731
    theirs = compute_forward_kl_topk(x, nested(t_lp), nested(t_ids), _Config(clamp), "thd")
    theirs["distillation_losses"].sum().backward()
    y = logits.clone().requires_grad_()
    s_lp = torch.log_softmax(y, -1)
    ours = losses.topk_forward_kl(s_lp.gather(-1, t_ids), t_lp, log_prob_min_clamp=clamp)
    ours.kl.sum().backward()
    # verl computes its KL in float32 (``.float()``) whatever the inputs; ours stays in float64 here
    for a, b in ((ours.kl, theirs["distillation_losses"]), (ours.student_mass, theirs["student_mass"]),
                 (ours.teacher_mass, theirs["teacher_mass"])):
        torch.testing.assert_close(a.detach(), b.detach().double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-6)
    student_top = s_lp.topk(t_ids.shape[-1], dim=-1).indices
    count, adv = losses.topk_overlap(t_ids, student_top, ours.per_id)
    assert torch.equal(count, theirs["overlap_count"])
    torch.testing.assert_close(adv, theirs["overlap_token_advantage"].detach().double(), rtol=1e-5, atol=1e-6)
    if clamp == -3.0:
        assert (s_lp.gather(-1, t_ids) < clamp).any()  # the clamp binds somewhere (and passes no gradient there)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("tail", [False, True])
def test_sparse_divergence_is_trls(beta, tail):
    logits, t_lp, t_ids = _case(1)
    valid = torch.ones_like(t_lp, dtype=torch.bool)
    valid[0, 2, 3:] = False  # a shorter support on one token
    y = logits.clone().requires_grad_()
    s = torch.log_softmax(y, -1).gather(-1, t_ids)
    ours = losses.sparse_divergence(s, t_lp, beta=beta, tail=tail, support_mask=valid)
    x = logits.clone().requires_grad_()
    s2 = torch.log_softmax(x, -1).gather(-1, t_ids)
    neg = torch.tensor(-math.inf, dtype=s2.dtype)
    s2, t2 = torch.where(valid, s2, neg), torch.where(valid, t_lp, neg)
    mask = valid
    if tail:
        s2, mask = _add_tail_bucket(s2, valid)
        t2, _ = _add_tail_bucket(t2, valid)
    theirs = _jsd_divergence(s2, t2, beta, mask).sum(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-10, atol=1e-12)
    if tail:  # with the tail both sides are distributions: a divergence, > 0 where they differ
        assert (ours > 0).all()


def test_sparse_forward_kl_renormalized_is_trls_no_tail_path():
    logits, t_lp, t_ids = _case(2)
    s = torch.log_softmax(logits, -1).gather(-1, t_ids)
    ours = losses.sparse_divergence(s, t_lp, renormalize=True)
    mask = torch.ones_like(s, dtype=torch.bool)
    theirs = _jsd_divergence(s - torch.logsumexp(s, -1, keepdim=True), t_lp - torch.logsumexp(t_lp, -1, keepdim=True),
                             0.0, mask).sum(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_bad_input_is_named():
    _, t_lp, t_ids = _case(3)
    s = t_lp + 0.1
    for call, exc, name in (
        (lambda: losses.topk_forward_kl(s[..., :3], t_lp), ValueError, "teacher_log_probs"),
        (lambda: losses.topk_forward_kl(s, t_lp.masked_fill(t_lp < -2, math.nan)), ValueError, "NaN"),
        (lambda: losses.topk_forward_kl(s, t_lp, log_prob_min_clamp=math.inf), ValueError, "log_prob_min_clamp"),
        (lambda: losses.sparse_divergence(s, t_lp, beta=1.5), ValueError, "beta"),
        (lambda: losses.sparse_divergence(s, t_lp, tail=True, renormalize=True), ValueError, "renormalize"),
        (lambda: losses.sparse_divergence(s, t_lp, support_mask=torch.ones(3)), ValueError, "support_mask"),
        (lambda: losses.topk_overlap(t_ids.float(), t_ids, s), TypeError, "teacher_ids"),
        (lambda: losses.topk_forward_kl(s[..., :0], t_lp[..., :0]), ValueError, "K >= 1"),
    ):
        with pytest.raises(exc, match=name):
            call()


@pytest.mark.parametrize("trl_beta", [0.0, 0.3, 1.0])
def test_each_divergence_class_is_one_math(trl_beta):
    """The fused ops' block form (``terms``, ``grad``, ``grad_from_parts``) and the sparse losses' per-entry
    form (``entries``) of each divergence class agree, and the block gradient is the float64 autograd
    gradient of the entries' sum w.r.t. the student's logits."""
    spec = Divergence.from_trl_beta(trl_beta)
    assert spec.kind == {0.0: "forward_kl", 1.0: "reverse_kl"}.get(trl_beta, "jsd")
    math_ = spec.math
    g = torch.Generator().manual_seed(4)
    zs = (torch.randn(5, 17, generator=g, dtype=torch.float64) * 2).requires_grad_()
    zt = torch.randn(5, 17, generator=g, dtype=torch.float64) * 2
    lp_s, lp_t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    d = math_.entries(lp_s, lp_t).sum(-1)
    # the definition, written independently (TRL's generalized JSD, its limits the KLs)
    ps, pt = lp_s.exp(), lp_t.exp()
    if trl_beta == 0.0:
        ref = (pt * (lp_t - lp_s)).sum(-1)
    elif trl_beta == 1.0:
        ref = (ps * (lp_s - lp_t)).sum(-1)
    else:
        m = (1 - trl_beta) * ps + trl_beta * pt
        ref = trl_beta * (pt * (lp_t - m.log())).sum(-1) + (1 - trl_beta) * (ps * (lp_s - m.log())).sum(-1)
    torch.testing.assert_close(d, ref, rtol=1e-12, atol=1e-14)
    up = torch.randn(5, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((d * up).sum(), zs)
    ls, lt = lp_s.detach(), lp_t.detach()
    div, aux, parts = math_.terms(ls.clone(), lt.clone())
    torch.testing.assert_close(div, ref.detach(), rtol=1e-12, atol=1e-14)
    aux = div if spec.kind == "reverse_kl" else aux
    for block in (math_.grad(ls.clone(), lt.clone(), aux),
                  math_.grad_from_parts(parts, lambda: ls.clone(), aux)):
        torch.testing.assert_close(block * up.unsqueeze(1), grad, rtol=1e-10, atol=1e-12)
