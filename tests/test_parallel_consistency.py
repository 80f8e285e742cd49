"""Ranks of a tensor-parallel group that make different calls get a clear error, on every rank.

Each case gives the two ranks of a real gloo group inputs that differ in one
way; before the fix these gave silently wrong log-probs, hung or killed gloo.
Every rank must raise a ValueError naming what differs and the ranks' values,
and the group must still work afterwards (a correct call follows each case).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chunked_entropy import linear_log_probs_and_entropy, log_probs_and_entropy
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
    lp, _ = log_probs_and_entropy(full[:, rank * 5 : rank * 5 + 5], labels, process_group=group)
    ref, _ = reference(full.double(), labels)
    torch.testing.assert_close(lp.double(), ref)


def _cases(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 3, 6, generator=g)
    labels = torch.randint(0, 12, (4, 3), generator=g)
    other = rank  # differs between the two ranks

    def lp(**kw):
        args = dict(logits=z, labels=labels, process_group=group)
        args.update(kw)
        return log_probs_and_entropy(args.pop("logits"), args.pop("labels"), **args)

    cases = [
        ("vocabulary shard width", lambda: lp(logits=z[..., : 5 + other], labels=labels % 10)),
        ("labels", lambda: lp(labels=labels.clone().index_put_((torch.tensor([2]), torch.tensor([1])),
                                                                torch.tensor(other)))),
        ("temperature", lambda: lp(temperature=0.5 + other)),
        ("temperature", lambda: lp(temperature=torch.full((4, 1), 1.0 + 0.25 * other))),
        ("chunk_size", lambda: lp(chunk_size=2 + other)),
        ("compute_entropy", lambda: lp(compute_entropy=bool(other))),
        ("compute_sum_pi_squared", lambda: lp(compute_sum_pi_squared=bool(other))),
        ("softcap", lambda: lp(softcap=30.0 + other)),
        ("token count", lambda: lp(logits=z[: 3 + other], labels=labels[: 3 + other])),
        ("labels", lambda: lp(label_mask=torch.arange(12).reshape(4, 3) != other)),
    ]
    # the fused head: sequence-parallel slices of unequal length, and vocabulary blocks
    w = torch.randn(6, 5, generator=g)
    h = torch.randn(5, 3, 5, generator=g)

    def head(**kw):
        args = dict(hidden=h[:4], labels=torch.randint(0, 12, (8, 3), generator=torch.Generator().manual_seed(2)),
                    process_group=group, sequence_parallel=True)
        args.update(kw)
        return linear_log_probs_and_entropy(args.pop("hidden"), w, args.pop("labels"), **args)

    cases += [
        ("token count", lambda: head(hidden=h[: 4 + other], labels=torch.zeros(2 * (4 + other), 3, dtype=torch.long))),
        ("vocab_chunk_size", lambda: head(vocab_chunk_size=3 + other)),
        ("whether gradients are computed", lambda: head(hidden=h[:4].clone().requires_grad_(bool(other)))),
    ]
    for what, call in cases:
        _expect_error(rank, what, call)
        _healthy(rank, group)


def test_calls_that_differ_across_ranks_raise_on_every_rank():
    run_distributed(_cases, 2)
