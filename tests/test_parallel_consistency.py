"""Ranks of a tensor-parallel group that make different calls get a clear error, on every rank.

Each case gives the two ranks of a real gloo group inputs that differ in one
way; before the fix these gave silently wrong log-probs, hung or killed gloo.
Every rank must raise a ValueError naming what differs and the ranks' values,
and the group must still work afterwards (a correct call follows each case).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    Chunking,
    OutputLayer,
    PolicyLoss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from tests.helpers import reference, run_distributed


def _expect_error(rank, what, call):
    try:
        call()
    except ValueError as e:
        msg = str(e)
        assert what in msg and "rank 0" in msg and "rank 1" in msg and f"this is rank {rank}" in msg, msg
    else:
        raise AssertionError(f"rank {rank}: no error when {what} differs across ranks")


def _healthy(rank, group):
    """A correct call after a refused one: the group is not left half-way through a collective."""
    full = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(6)
    lp, _ = log_probs_and_entropy(full[:, rank * 5 : rank * 5 + 5], labels, layer=OutputLayer(process_group=group))
    ref, _ = reference(full.double(), labels)
    torch.testing.assert_close(lp.double(), ref)


def _cases(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 3, 6, generator=g)
    labels = torch.randint(0, 12, (4, 3), generator=g)
    other = rank  # differs between the two ranks

    def lp(layer=(), **kw):
        args = dict(logits=z, labels=labels)
        args.update(kw)
        return log_probs_and_entropy(args.pop("logits"), args.pop("labels"),
                                     layer=OutputLayer(process_group=group, **dict(layer)), **args)

    cases = [
        ("vocabulary shard width", lambda: lp(logits=z[..., : 5 + other], labels=labels % 10)),
        ("labels", lambda: lp(labels=labels.clone().index_put_((torch.tensor([2]), torch.tensor([1])),
                                                                torch.tensor(other)))),
        ("temperature", lambda: lp(temperature=0.5 + other)),
        ("temperature", lambda: lp(temperature=torch.full((4, 1), 1.0 + 0.25 * other))),
        ("chunking.chunk_size", lambda: lp(chunking=2 + other)),
        ("compute_entropy", lambda: lp(compute_entropy=bool(other))),
        ("compute_sum_pi_squared", lambda: lp(compute_sum_pi_squared=bool(other))),
        ("softcap", lambda: lp(layer=dict(softcap=30.0 + other))),
        ("token count", lambda: lp(logits=z[: 3 + other], labels=labels[: 3 + other])),
        ("labels", lambda: lp(label_mask=torch.arange(12).reshape(4, 3) != other)),
        # an argument given on one rank only: named (it was "the ranks made different calls", naming nothing)
        ("log_probs_at", lambda: lp(log_probs_at=[None, torch.zeros(4, 3, 2, dtype=torch.long)][other])),
        ("keep", lambda: lp(keep=[None, {"top_k": 2}][other])),
        ("rows", lambda: lp(labels=labels.reshape(-1)[:5], rows=[torch.arange(5), torch.arange(1, 6)][other])
         if other else lp(labels=labels.reshape(-1)[:5], logits=z.reshape(-1, 6)[:5])),
        # the ranks' values as written (they were fingerprints and float bit patterns), and the option that differs
        ("softcap differs across the 2 ranks of process_group (rank 0: 30.0, rank 1: 31.0",
         lambda: lp(layer=dict(softcap=30.0 + other))),
        ("loss.options differs across the 2 ranks of process_group (clip_ratio_high: rank 0: 0.25, rank 1: 0.5;",
         lambda: policy_loss_from_logits(z, labels, -torch.ones(4, 3), torch.ones(4, 3),
                                         torch.ones(4, 3, dtype=torch.bool), layer=OutputLayer(process_group=group),
                                         loss=PolicyLoss(options={"clip_ratio_high": 0.25 * (1 + other)}))),
        ("loss.aggregation differs across the 2 ranks of process_group (mode: rank 0: 'token-mean', rank 1: 'token-sum",
         lambda: policy_loss_from_logits(z, labels, -torch.ones(4, 3), torch.ones(4, 3),
                                         torch.ones(4, 3, dtype=torch.bool), layer=OutputLayer(process_group=group),
                                         loss=PolicyLoss(aggregation=["token-mean", "token-sum"][other]))),
        ("rollout_log_probs", lambda: policy_loss_from_logits(
            z, labels, -torch.ones(4, 3), torch.ones(4, 3), torch.ones(4, 3, dtype=torch.bool),
            layer=OutputLayer(process_group=group), rollout_log_probs=[None, -torch.ones(4, 3)][other])),
    ]
    # the fused head: sequence-parallel slices of unequal length, and vocabulary blocks
    w = torch.randn(6, 5, generator=g)
    h = torch.randn(5, 3, 5, generator=g)

    def head(**kw):
        args = dict(hidden=h[:4], labels=torch.randint(0, 12, (8, 3), generator=torch.Generator().manual_seed(2)))
        args.update(kw)
        layer = OutputLayer(w, process_group=group, sequence_parallel=True)
        return linear_log_probs_and_entropy(args.pop("hidden"), layer, args.pop("labels"), **args)

    cases += [
        ("token count", lambda: head(hidden=h[: 4 + other], labels=torch.zeros(2 * (4 + other), 3, dtype=torch.long))),
        ("vocab_chunk_size", lambda: head(chunking=Chunking(vocab_chunk_size=3 + other))),
        ("whether gradients are computed", lambda: head(hidden=h[:4].clone().requires_grad_(bool(other)))),
    ]
    for what, call in cases:
        _expect_error(rank, what, call)
        _healthy(rank, group)


def test_calls_that_differ_across_ranks_raise_on_every_rank():
    run_distributed(_cases, 2)


# ------------------------------------------------------------ one rank's own arguments are refused: no hang


def _same_error_everywhere(rank, world, what, call):
    """``call()`` raises on every rank the same message (up to "this is rank r"), naming ``what``.

    The message exchange is itself a collective: had the library left a peer
    waiting, it would time out (the harness bounds every collective).
    """
    try:
        call()
        msg = None
    except (ValueError, TypeError) as e:
        msg = f"{type(e).__name__}: {e}"
    every = [None] * world
    dist.all_gather_object(every, msg)
    assert all(m is not None for m in every), f"{what}: not every rank raised: {every}"
    assert len({re.sub(r"this is rank \d+", "this is rank R", m) for m in every}) == 1, every
    assert what in msg, msg


def _refused_on_one_rank(rank, world):
    group = dist.group.WORLD
    bad = rank == world - 1  # only the last rank's arguments are wrong
    g = torch.Generator().manual_seed(3)
    v_local = 5
    z = torch.randn(4, 3, v_local, generator=g)
    labels = torch.randint(0, v_local * world, (4, 3), generator=g)
    hidden, weight = torch.randn(4, 3, 6, generator=g), torch.randn(v_local, 6, generator=g)
    old, adv = torch.randn(4, 3, generator=g) - 3, torch.randn(4, 3, generator=g)
    mask = torch.ones(4, 3, dtype=torch.bool)

    def out_of_range():
        lab = labels.clone()
        if bad:
            lab[1, 2] = v_local * world + 3
        return log_probs_and_entropy(z, lab, layer=OutputLayer(process_group=group))

    cases = [
        ("labels must be vocabulary ids", out_of_range),
        ("temperature", lambda: log_probs_and_entropy(z, labels, layer=OutputLayer(process_group=group),
                                                      temperature=0.0 if bad else 1.0)),
        ("labels must have the leading shape",
         lambda: log_probs_and_entropy(z, labels[:3] if bad else labels, layer=OutputLayer(process_group=group))),
        ("old_log_probs", lambda: linear_policy_loss(hidden, OutputLayer(weight, process_group=group), labels,
                                                     old[:2] if bad else old, adv, mask)),
        ("old_log_probs", lambda: policy_loss_from_logits(z, labels, old[:, :1] if bad else old, adv, mask,
                                                          layer=OutputLayer(process_group=group))),
        ("logits must be a torch.Tensor",
         lambda: log_probs_and_entropy(z.tolist() if bad else z, labels, layer=OutputLayer(process_group=group))),
        ("chunk_size", lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight, process_group=group), labels,
                                                            chunking=0 if bad else 4)),
        ("ignore_index", lambda: log_probs_and_entropy(z, labels, layer=OutputLayer(process_group=group),
                                                       ignore_index=None if bad else -100)),
    ]
    for what, call in cases:
        _same_error_everywhere(rank, world, what, call)
        _healthy_any(rank, world, group)


def _healthy_any(rank, world, group):
    full = torch.randn(6, 5 * world, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(6) * (world - 1)
    lp, _ = log_probs_and_entropy(full[:, rank * 5: rank * 5 + 5], labels, layer=OutputLayer(process_group=group))
    ref, _ = reference(full.double(), labels)
    torch.testing.assert_close(lp.double(), ref)


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_refused_on_one_rank_raises_the_same_error_on_every_rank(world):
    run_distributed(_refused_on_one_rank, world, timeout_s=60)


def _dtype_and_hidden_size(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(4)
    z = torch.randn(4, 6, generator=g)
    labels = torch.randint(0, 6 * world, (4,), generator=g)
    _expect_error(rank, "dtype", lambda: log_probs_and_entropy(z.double() if rank else z, labels,
                                                               layer=OutputLayer(process_group=group)))
    h = 5 + rank  # a different hidden size on each rank
    hidden, weight = torch.randn(4, h, generator=g), torch.randn(6, h, generator=g)
    _expect_error(rank, "hidden size", lambda: linear_log_probs_and_entropy(hidden,
                                                                            OutputLayer(weight, process_group=group),
                                                                            labels))
    _healthy(rank, group)



def _cancelling_labels(rank, world):
    group = dist.group.WORLD
    z = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    labels = torch.tensor([3, 5, 7, 9])
    if rank == 1:
        # the previous fingerprint was sum(id_i * (i + 1)): +2 at position 0 and -1 at position 1 cancel
        labels = torch.tensor([5, 4, 7, 9])
    _expect_error(rank, "labels", lambda: log_probs_and_entropy(z, labels, layer=OutputLayer(process_group=group)))
    _healthy(rank, group)



def _not_a_member(rank, world):
    only_rank_0 = dist.new_group([0])  # every rank creates it; only rank 0 belongs
    z = torch.randn(3, 4)
    labels = torch.tensor([0, 1, 2])
    if rank == 0:
        lp, _ = log_probs_and_entropy(z, labels, layer=OutputLayer(process_group=only_rank_0))  # a group of one: plain
        torch.testing.assert_close(lp.double(), reference(z.double(), labels)[0])
    else:
        with pytest.raises(ValueError, match=r"this process \(global rank 1\) is not a member of process_group"):
            log_probs_and_entropy(z, labels, layer=OutputLayer(process_group=only_rank_0))


def _requires_grad_differs(rank, world):
    """Ranks agree on every other argument, but only rank 1's hidden states need a gradient: only it would
    all-reduce one (gloo aborted the process: "Received data size doesn't match expected size")."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 3, 6, generator=g).requires_grad_(rank == 1)
    weight = torch.randn(5, 6, generator=g, requires_grad=True)
    labels = torch.randint(0, 5 * world, (4, 3), generator=torch.Generator().manual_seed(7))
    old, adv, mask = torch.full((4, 3), -2.0), torch.ones(4, 3), torch.ones(4, 3, dtype=torch.bool)
    what = "hidden.requires_grad (under grad mode) differs across the 2 ranks of process_group (rank 0: 0, rank 1: 1"
    calls = [
        lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight, process_group=group), labels),
        lambda: linear_log_probs_and_entropy(hidden[:2], OutputLayer(weight, process_group=group,
                                                                     sequence_parallel=True), labels),  # SP
        lambda: linear_policy_loss(hidden, OutputLayer(weight, process_group=group), labels, old, adv, mask),
    ]
    for call in calls:
        _expect_error(rank, what, call)
        _healthy(rank, group)


def _requires_grad_fuzz(rank, world):
    """Randomized (seeded alike on every rank): which of hidden, weight and bias need a gradient on each
    rank, grad mode per rank, sequence parallelism, the head or the fused loss. Where the ranks' collectives
    would differ, every rank raises the same error naming it; elsewhere the call matches float64."""
    import functools
    import random

    group, draw = dist.group.WORLD, random.Random(2026)
    v_local, hdim, s_len, b = 4, 3, 2 * world, 2
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(s_len, b, hdim, generator=g, dtype=torch.float64)  # [S, B, H]
    weight = torch.randn(v_local * world, hdim, generator=g, dtype=torch.float64)
    bias = torch.randn(v_local * world, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v_local * world, (s_len, b), generator=g)
    ups = torch.randn(s_len, b, generator=g, dtype=torch.float64)
    hr, wr, br = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    lp_ref, _ = reference(hr @ wr.t() + br, labels)  # [S, B]
    shard = slice(rank * v_local, (rank + 1) * v_local)
    for _ in range(24):
        flags = [[draw.random() < 0.6 for _ in range(3)] for _ in range(world)]  # per rank: hidden, weight, bias
        grad_mode = [draw.random() < 0.85 for _ in range(world)]
        sp, loss_path = draw.random() < 0.5, draw.random() < 0.4
        mine, on = flags[rank], grad_mode[rank]
        need_h = {gm and f[0] for f, gm in zip(flags, grad_mode, strict=True)}
        any_grad = {gm and any(f) for f, gm in zip(flags, grad_mode, strict=True)}
        # the head takes [S, B, H] ([S/P, B, H] under SP); the fused loss [B, T, H] ([T/P, B, H] under SP)
        src = hidden.transpose(0, 1) if loss_path and not sp else hidden
        h = (src[rank * 2: rank * 2 + 2] if sp else src).clone().requires_grad_(mine[0])
        w, bb = weight[shard].clone().requires_grad_(mine[1]), bias[shard].clone().requires_grad_(mine[2])
        old = lp_ref.detach().t().contiguous()  # ratio 1: inside the clip range, the plain PPO gradient
        layer = OutputLayer(w, bb, process_group=group, sequence_parallel=sp)
        if loss_path:
            call = functools.partial(linear_policy_loss, h, layer, labels.t().contiguous(), old, ups.t().contiguous(),
                                     torch.ones(b, s_len, dtype=torch.bool), chunking=3)
        else:
            call = functools.partial(linear_log_probs_and_entropy, h, layer, labels, chunking=Chunking(3, 3))
        with torch.set_grad_enabled(on):
            if len(any_grad) > 1:
                _expect_error(rank, "whether gradients are computed", call)
                continue
            if len(need_h) > 1:
                _expect_error(rank, "hidden.requires_grad", call)
                continue
            out = call()
        if loss_path:
            loss, want = out[0], (-ups * torch.exp(lp_ref - lp_ref.detach())).mean()
        else:
            torch.testing.assert_close(out.log_probs, lp_ref.detach(), rtol=1e-9, atol=1e-9)
            loss, want = (out.log_probs * ups).sum(), (lp_ref * ups).sum()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-9, atol=1e-9)
        if not on or not any(mine):
            continue
        loss.backward()
        gh, gw, gb = torch.autograd.grad(want, (hr, wr, br), retain_graph=True)
        gh = gh.transpose(0, 1) if loss_path and not sp else gh
        for leaf, ref in ((h, gh[rank * 2: rank * 2 + 2] if sp else gh), (w, gw[shard]), (bb, gb[shard])):
            if leaf.requires_grad:
                torch.testing.assert_close(leaf.grad, ref, rtol=1e-8, atol=1e-9)


def _two_rank_checks(rank, world):
    _requires_grad_differs(rank, world)
    _requires_grad_fuzz(rank, world)
    _dtype_and_hidden_size(rank, world)
    _cancelling_labels(rank, world)
    _not_a_member(rank, world)


def test_dtypes_hidden_sizes_cancelling_labels_and_a_group_without_this_rank():
    """Ranks that differ in whether the hidden states need a gradient, a float64 rank beside a float32 one and
    unequal hidden sizes are named (they used to kill gloo); label
    differences that cancel in a linear fingerprint are caught; a group this rank is not in is named. One spawn."""
    run_distributed(_two_rank_checks, 2, timeout_s=60)


def _folded_agreement(rank, world):
    from chunked_entropy.parallel import CHECK_SLOTS, agreed_call

    group = dist.group.WORLD
    n = 3 * CHECK_SLOTS  # more agreed values than the exchange has slots: they travel as one fingerprint
    values = {f"field {i}": (i, -(2**62) + i) if i % 2 else i * 1_000_003 for i in range(n)}
    with agreed_call(group) as call:
        call.agree_all(values)
    # every 64-bit piece of a value counts: values that differ by a multiple of the fingerprint's prime, or in
    # their high bits only, are named with each rank's value, in the message the slots gave
    for i, (mine, theirs) in enumerate([(5, 5 + 2_147_483_629), (1 << 50, 1 << 51), (-1, 2**63 - 1)]):
        name = f"field {n // 2 + i}"
        changed = dict(values, **{name: mine if rank == 0 else theirs})
        try:
            with agreed_call(group) as call:
                call.agree_all(changed)
        except ValueError as e:
            assert str(e).startswith(f"{name} differs across the 2 ranks of process_group (rank 0: {mine}, rank 1: "
                                     f"{theirs}; this is rank {rank})"), str(e)
        else:
            raise AssertionError(f"rank {rank}: no error when {name} differs")
    _healthy(rank, group)


def test_the_ranks_agree_on_one_fingerprint_of_every_value():
    """Issue 46 item 1: one exchange carries the call's agreed values (the objects' fields and the tensors'
    metadata) as one fingerprint, so their number is not bounded by the exchange's slots (a call with more
    raised "checks exceed CHECK_SLOTS"); a difference anywhere in a value is still named with each rank's value."""
    run_distributed(_folded_agreement, 2, timeout_s=60)
