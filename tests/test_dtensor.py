"""Vocabulary-sharded DTensor logits and column-parallel DTensor weights, over real gloo (spawned processes).

Every value and gradient against float64 on the gathered tensors (large logit offsets, confident rows, a
small temperature, random upstream gradients on every output), the outputs' and gradients' placements, and
next to ours ``torch.distributed.tensor.parallel.loss_parallel()``'s gradients of an entropy and a KL, which
pytorch #190746 makes wrong (inside ``loss_parallel``, DTensor's ``_log_softmax_backward`` hands the
upstream gradient on unchanged: only a log-softmax consumed by ``cross_entropy`` is right). That part
asserts the bug is still there, so that this test says when torch fixes it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunked_entropy import (
    ChunkedVocabParallelHead,
    OutputLayer,
    divergence_from_logits,
    linear_log_probs_and_entropy,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from tests.helpers import run_distributed

V, H = 16, 8
T = 0.7  # a small temperature


def _logits(n, seed, *, dtype=torch.float32):
    """Rows with a large offset (1e3), a confident row, a few ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g, dtype=torch.float64) * 3
    x[0] += 1e3
    x[1, 5] += 40.0  # confident
    return x.to(dtype)


def _ref_entropy_lp(x64, labels, t):
    lsm = F.log_softmax(x64 / t, -1)
    return lsm.gather(-1, labels[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def _close(a, b, what, rtol=2e-5, atol=2e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _wrong_by_190746(grad, ref, ours, what):
    """loss_parallel's gradient: still wrong (pytorch #190746), told apart from float32 rounding."""
    err, ours_err = (grad.double() - ref).abs().max().item(), (ours.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err > 1e-2 * scale and err > 1e3 * max(ours_err, 1e-9), (
        f"pytorch #190746 looks fixed in torch {torch.__version__}: loss_parallel()'s {what} gradient is now off by "
        f"{err:.3g} (ours {ours_err:.3g}, gradient scale {scale:.3g}). Update the docs that name the bug "
        "(docs/integrations/torchtitan.md, docs/exact-tp.md) and turn this check into an exactness check."
    )


def _one_d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (world,))
    n = 6
    x64 = _logits(n, 1, dtype=torch.float64)
    labels = torch.tensor([3, 5, 0, V - 1, 8, 11])
    g = torch.Generator().manual_seed(7)
    g_lp, g_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    # ---- log-probs and entropy: values, placements, the logits' gradient
    xr = x64.clone().requires_grad_()
    lp_ref, h_ref = _ref_entropy_lp(xr, labels, T)
    ((lp_ref * g_lp).sum() + (h_ref * g_h).sum()).backward()
    d = distribute_tensor(x64.float(), mesh, [Shard(1)]).requires_grad_()
    out = log_probs_and_entropy(d, labels, temperature=T, chunking=4)
    assert isinstance(out.entropy, DTensor) and out.entropy.placements == (Replicate(),)
    assert out.log_probs.shape == (n,) and out.log_probs.to_local().shape == (n,)
    _close(out.log_probs.full_tensor(), lp_ref, "log_probs")
    _close(out.entropy.full_tensor(), h_ref, "entropy")
    up = lambda t: DTensor.from_local(t.float(), mesh, [Replicate()], run_check=False)  # noqa: E731
    ((out.log_probs * up(g_lp)).sum() + (out.entropy * up(g_h)).sum()).backward()
    assert isinstance(d.grad, DTensor) and d.grad.placements == (Shard(1),)
    ours = d.grad.full_tensor()
    _close(ours, xr.grad, "d(log_probs, entropy)/d logits")

    # ---- rows=: the selected rows' outputs, a DTensor of their shape; the gradient zero on the other rows
    d = distribute_tensor(x64.float(), mesh, [Shard(1)]).requires_grad_()
    rows = torch.tensor([4, 1, 4])
    sel = log_probs_and_entropy(d, labels[rows], temperature=T, rows=rows)
    assert sel.entropy.shape == (3,) and sel.entropy.placements == (Replicate(),)
    lp_r, h_r = _ref_entropy_lp(x64[rows], labels[rows], T)
    _close(sel.log_probs.full_tensor(), lp_r, "rows= log_probs")
    _close(sel.entropy.full_tensor(), h_r, "rows= entropy")
    sel.entropy.sum().backward()
    assert (d.grad.full_tensor()[[0, 2, 3, 5]] == 0).all()

    # ---- the entropy alone, next to loss_parallel's (pytorch #190746)
    xr = x64.clone().requires_grad_()
    (_ref_entropy_lp(xr, labels, T)[1] * g_h).sum().backward()
    d = distribute_tensor(x64.float(), mesh, [Shard(1)]).requires_grad_()
    (log_probs_and_entropy(d, labels, temperature=T).entropy * up(g_h)).sum().backward()
    ours = d.grad.full_tensor()
    _close(ours, xr.grad, "d entropy / d logits")
    dl = distribute_tensor(x64.float(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        lsm = F.log_softmax(dl / T, -1)
        h_lp = -(lsm.exp() * lsm).sum(-1)
        (h_lp * up(g_h)).sum().backward()
    _close(h_lp.full_tensor(), _ref_entropy_lp(x64, labels, T)[1], "loss_parallel's entropy value", atol=1e-4)
    _wrong_by_190746(dl.grad.full_tensor(), xr.grad, ours, "entropy")

    # ---- a KL(teacher || student), ours next to loss_parallel's
    t64 = _logits(n, 2, dtype=torch.float64)
    xr = x64.clone().requires_grad_()
    pt = F.softmax(t64 / T, -1)
    kl_ref = (pt * (F.log_softmax(t64 / T, -1) - F.log_softmax(xr / T, -1))).sum(-1)
    (kl_ref * g_h).sum().backward()
    d = distribute_tensor(x64.float(), mesh, [Shard(1)]).requires_grad_()
    dt = distribute_tensor(t64.float(), mesh, [Shard(1)])
    kl = divergence_from_logits(d, dt, divergence="forward_kl", temperature=T).divergence
    assert isinstance(kl, DTensor) and kl.placements == (Replicate(),)
    _close(kl.full_tensor(), kl_ref.detach(), "KL", atol=1e-4)
    (kl * up(g_h)).sum().backward()
    ours = d.grad.full_tensor()
    _close(ours, xr.grad, "d KL / d student logits")
    dl = distribute_tensor(x64.float(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        s_lsm = F.log_softmax(dl / T, -1)
        t_lsm = F.log_softmax(dt / T, -1)
        kl_lp = (t_lsm.exp() * (t_lsm - s_lsm)).sum(-1)
        (kl_lp * up(g_h)).sum().backward()
    _wrong_by_190746(dl.grad.full_tensor(), xr.grad, ours, "KL")

    # ---- the policy loss: a DTensor scalar, replicated; the same gradient as on the plain full logits
    old = -torch.rand(1, n, generator=g)
    adv = torch.randn(1, n, generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    d = distribute_tensor(x64.float()[None], mesh, [Shard(2)]).requires_grad_()
    loss, _ = policy_loss_from_logits(d, labels[None], old, adv, mask, temperature=T)
    assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
    loss.backward()
    xp = x64.float()[None].clone().requires_grad_()
    loss_p, _ = policy_loss_from_logits(xp, labels[None], old, adv, mask, temperature=T)
    loss_p.backward()
    _close(loss.full_tensor(), loss_p.detach(), "policy loss")
    _close(d.grad.full_tensor(), xp.grad, "policy loss gradient", rtol=1e-5, atol=1e-6)

    # ---- the fused head: a column-parallel DTensor weight (Shard(0)), DTensor or plain hidden states
    gw = torch.Generator().manual_seed(3)
    w64 = torch.randn(V, H, generator=gw, dtype=torch.float64) / 2
    h64 = torch.randn(n, H, generator=gw, dtype=torch.float64) * 3
    wr, hr = w64.clone().requires_grad_(), h64.clone().requires_grad_()
    lp_ref, h_ref = _ref_entropy_lp(hr @ wr.T, labels, T)
    ((lp_ref * g_lp).sum() + (h_ref * g_h).sum()).backward()
    for hidden_kind in ("dtensor", "plain", "sequence-sharded"):
        w = distribute_tensor(w64.float(), mesh, [Shard(0)]).requires_grad_()
        if hidden_kind == "plain":
            hid = h64.float().clone().requires_grad_()
            h_in = hid
        else:
            hid = distribute_tensor(h64.float(), mesh, [Shard(0) if hidden_kind == "sequence-sharded"
                                                        else Replicate()]).requires_grad_()
            h_in = hid
        out = linear_log_probs_and_entropy(h_in, OutputLayer(w), labels, temperature=T, chunking=4)
        if hidden_kind == "plain":
            assert not isinstance(out.entropy, DTensor)
            ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
            h_grad = hid.grad
        else:
            assert isinstance(out.entropy, DTensor) and out.entropy.placements == (Replicate(),)
            ((out.log_probs * up(g_lp)).sum() + (out.entropy * up(g_h)).sum()).backward()
            assert hid.grad.placements == hid.placements
            h_grad = hid.grad.full_tensor()
        lp_v = out.log_probs.full_tensor() if hidden_kind != "plain" else out.log_probs
        _close(lp_v, lp_ref.detach(), f"fused log_probs ({hidden_kind} hidden)")
        assert isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),)
        _close(w.grad.full_tensor(), wr.grad, f"fused d/d weight ({hidden_kind} hidden)")
        _close(h_grad, hr.grad, f"fused d/d hidden ({hidden_kind} hidden)")
    head = ChunkedVocabParallelHead(distribute_tensor(w64.float(), mesh, [Shard(0)]), chunking=4)
    _close(head(distribute_tensor(h64.float(), mesh, [Replicate()]), labels, temperature=T).entropy.full_tensor(),
           h_ref.detach(), "ChunkedVocabParallelHead entropy")

    # ---- refused by name, on every rank, before any work
    from torch.distributed.tensor import Partial

    x = _logits(n, 1)
    bad = [
        (DTensor.from_local(x, mesh, [Partial()], run_check=False), r"logits is a DTensor placed .*Partial"),
        (distribute_tensor(_logits(n, 1)[:, :V - 1], mesh, [Shard(1)]), r"split unevenly over 2 ranks"),
    ]
    for logits, match in bad:
        with pytest.raises(ValueError, match=match):
            log_probs_and_entropy(logits, labels)
    other = torch.distributed.new_group(list(range(world)))
    with pytest.raises(ValueError, match=r"layer.process_group must be None or the DTensor's mesh group"):
        log_probs_and_entropy(distribute_tensor(x, mesh, [Shard(1)]), labels,
                              layer=OutputLayer(process_group=other))
    with pytest.raises(ValueError, match=r"teacher_logits is a DTensor placed"):
        divergence_from_logits(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(x, mesh, [Replicate()]))
    with pytest.raises(ValueError, match=r"labels is a DTensor placed .*expected \(Replicate\(\),\)"):
        log_probs_and_entropy(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(labels, mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"layer.weight is a DTensor placed .*Partial"):
        linear_log_probs_and_entropy(torch.randn(n, H), DTensor.from_local(torch.randn(V // world, H), mesh,
                                                                           [Partial()], run_check=False), labels)


def test_dtensor_logits_and_weights_exact_tp2_and_loss_parallel_still_wrong():
    run_distributed(_one_d, 2, timeout_s=120)


def _two_d(rank, world):
    """A 2 x 2 mesh ("dp", "tp"): rows sharded over dp, the vocabulary over tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    b, s = 4, 3
    x64 = torch.stack([_logits(s, 10 + i, dtype=torch.float64) for i in range(b)])
    labels = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(4))
    g_h = torch.randn(b, s, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    xr = x64.clone().requires_grad_()
    lp_ref, h_ref = _ref_entropy_lp(xr.reshape(-1, V), labels.reshape(-1), T)
    (h_ref.reshape(b, s) * g_h - lp_ref.reshape(b, s)).sum().backward()
    d = distribute_tensor(x64.float(), mesh, [Shard(0), Shard(2)]).requires_grad_()
    lab = distribute_tensor(labels, mesh, [Shard(0), Replicate()])  # a DTensor label, placed as the outputs
    out = log_probs_and_entropy(d, lab, temperature=T)
    assert out.entropy.placements == (Shard(0), Replicate()) and out.entropy.to_local().shape == (b // 2, s)
    _close(out.entropy.full_tensor(), h_ref.detach().reshape(b, s), "2-D mesh entropy")
    up = distribute_tensor(g_h.float(), mesh, [Shard(0), Replicate()])
    ((out.entropy * up).sum() - out.log_probs.sum()).backward()
    assert d.grad.placements == (Shard(0), Shard(2))
    _close(d.grad.full_tensor(), xr.grad, "2-D mesh d/d logits")
    with pytest.raises(ValueError, match=r"rows are sharded over another mesh dim"):
        policy_loss_from_logits(d, labels[:2], torch.zeros(2, s), torch.ones(2, s), torch.ones(2, s, dtype=torch.bool))
    assert isinstance(out.log_probs, DTensor)
    with pytest.raises(ValueError, match=r"rows= with logits a DTensor whose rows are sharded"):
        log_probs_and_entropy(d, lab, rows=torch.tensor([0]))

    # ---- the fused head on the 2-D mesh: a weight replicated over dp, hidden rows sharded over dp. Each dp rank's
    # weight gradient is its rows' part: a Partial over dp (as torch's own matmul gives), not a Replicate that
    # differs between the dp ranks
    from torch.distributed.tensor import Partial

    gw = torch.Generator().manual_seed(6)
    w64, h64 = torch.randn(V, H, generator=gw, dtype=torch.float64), torch.randn(b, s, H, generator=gw,
                                                                                 dtype=torch.float64)
    bias64 = torch.randn(V, generator=gw, dtype=torch.float64)
    wr, hr, br = (t.clone().requires_grad_() for t in (w64, h64, bias64))
    lp_ref, h_ref = _ref_entropy_lp((hr @ wr.T + br).reshape(-1, V), labels.reshape(-1), T)
    (h_ref.reshape(b, s) * g_h - lp_ref.reshape(b, s)).sum().backward()
    w = distribute_tensor(w64.float(), mesh, [Replicate(), Shard(0)]).requires_grad_()
    bias = distribute_tensor(bias64.float(), mesh, [Replicate(), Shard(0)]).requires_grad_()
    hid = distribute_tensor(h64.float(), mesh, [Shard(0), Replicate()]).requires_grad_()
    out = linear_log_probs_and_entropy(hid, OutputLayer(w, bias=bias), lab, temperature=T, chunking=2)
    assert out.entropy.placements == (Shard(0), Replicate())
    _close(out.entropy.full_tensor(), h_ref.detach().reshape(b, s), "2-D mesh fused entropy")
    ((out.entropy * up).sum() - out.log_probs.sum()).backward()
    assert w.grad.placements == (Partial(), Shard(0)), w.grad.placements
    assert bias.grad.placements == (Partial(), Shard(0)), bias.grad.placements
    _close(w.grad.full_tensor(), wr.grad, "2-D mesh fused d/d weight")
    _close(bias.grad.full_tensor(), br.grad, "2-D mesh fused d/d bias")
    assert hid.grad.placements == (Shard(0), Replicate())
    _close(hid.grad.full_tensor(), hr.grad, "2-D mesh fused d/d hidden")


def test_dtensor_on_the_tp_dim_of_a_2d_mesh_rows_sharded_over_dp():
    run_distributed(_two_d, 4, timeout_s=120)


def _one_rank_refused(rank, world):
    """A refusal of the DTensor front that only one rank of a TP group makes (its ``rows=``; a bad ``layer``)
    is shared through the ranks' agreement: every rank raises it within the collective timeout, none waits in
    the op's next collective, and the group serves the next call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_local_rank("tp")
    b, s = 2, 3
    x = torch.stack([_logits(s, 20 + i) for i in range(b)])
    labels = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(4))
    d = distribute_tensor(x, mesh, [Shard(0), Shard(2)])
    lab = distribute_tensor(labels, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"rows= with logits a DTensor whose rows are sharded"):
        log_probs_and_entropy(d, lab, rows=torch.tensor([0]) if tp == 0 else None)
    with pytest.raises((ValueError, TypeError), match=r"layer"):
        log_probs_and_entropy(d, lab, layer=OutputLayer() if tp == 0 else "not a layer")
    w = distribute_tensor(torch.randn(V, H, generator=torch.Generator().manual_seed(1)), mesh, [Replicate(), Shard(0)])
    hid = distribute_tensor(torch.randn(b, s, H, generator=torch.Generator().manual_seed(2)), mesh,
                            [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"rows= with hidden a DTensor whose rows are sharded"):
        linear_log_probs_and_entropy(hid, OutputLayer(w), lab, rows=torch.tensor([0]) if tp == 1 else None)
    out = log_probs_and_entropy(d, lab)  # the group still serves
    _close(out.entropy.full_tensor(), _ref_entropy_lp(x.double().reshape(-1, V), labels.reshape(-1), 1.0)[1]
           .reshape(b, s), "entropy after the refusals")


def test_a_refusal_of_one_rank_is_raised_on_every_rank():
    run_distributed(_one_rank_refused, 4, timeout_s=20, deadline_s=120)
