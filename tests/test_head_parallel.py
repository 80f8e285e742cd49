"""The fused head over a real gloo tensor-parallel group, with and without sequence parallelism.

Every rank builds the same full problem from a shared seed, takes its
vocabulary shard (rows ``[r*V_local, (r+1)*V_local)`` of the weight) and, with
sequence parallelism, its slice of the hidden states along dim 0; the float64
reference is computed on the full problem. Checked on every rank: the outputs
cover the full sequence, ``grad_hidden`` is this rank's slice (or all) of the
full reference gradient, ``grad_weight`` / ``grad_bias`` are this rank's shard.
Several checks share one spawn (each spawn costs seconds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chunked_entropy import ChunkedVocabParallelHead, Chunking, OutputLayer, linear_log_probs_and_entropy
from tests.helpers import reference, run_distributed

F32 = dict(rtol=1e-5, atol=1e-5)


def _close(actual, expected, what, rank):
    torch.testing.assert_close(actual.double(), expected, **F32, msg=lambda m: f"rank {rank}, {what}: {m}")


def _case(rank, group, *, seq, batch, h, v, bias, sequence_parallel, temperature, chunk_size,
          vocab_chunk_size=None, compute_entropy=True, masked=False, use_module=False, seed=0,
          tf=None, pi2=False):
    tf = tf or {}
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    hidden_full = torch.randn(seq, batch, h, generator=g)  # Megatron's [S, B, H]
    weight_full = torch.randn(v, h, generator=g) / h**0.5
    bias_full = torch.randn(v, generator=g) * 0.3
    labels = torch.randint(0, v, (batch, seq), generator=g).t().contiguous()  # [S, B]
    labels[0, 0] = v - 1  # an id in the last shard
    label_mask = None
    if masked:
        labels[1, -1] = -100
        label_mask = torch.rand(seq, batch, generator=g) > 0.25
    g_lp = torch.randn(seq, batch, generator=g, dtype=torch.float64)
    g_h = torch.randn(seq, batch, generator=g, dtype=torch.float64)
    g_q = torch.randn(seq, batch, generator=g, dtype=torch.float64)
    if temperature == "per-sample":
        temperature = torch.rand(1, batch, generator=g) + 0.5  # broadcasts over [S, B]

    # reference on the full problem, float64
    h64 = hidden_full.double().requires_grad_()
    w64 = weight_full.double().requires_grad_()
    b64 = bias_full.double().requires_grad_()
    logits = h64 @ w64.t() + (b64 if bias else 0)
    lp_ref, ent_ref, q_ref = reference(
        logits, labels, temperature=temperature, label_mask=label_mask, sum_pi_squared=True, **tf
    )
    ((lp_ref * g_lp).sum() + ((ent_ref * g_h).sum() if compute_entropy else 0)
     + ((q_ref * g_q).sum() if pi2 else 0)).backward()

    # this rank's inputs
    vl, sl = v // p, seq // p
    rows = slice(r * vl, (r + 1) * vl)
    seq_rows = slice(r * sl, (r + 1) * sl) if sequence_parallel else slice(None)
    hidden = hidden_full[seq_rows].clone().requires_grad_()
    weight = weight_full[rows].clone().requires_grad_()
    b = bias_full[rows].clone().requires_grad_() if bias else None

    kw = dict(temperature=temperature, compute_entropy=compute_entropy, label_mask=label_mask)
    if pi2:
        kw.update(compute_sum_pi_squared=pi2)
    layer = OutputLayer(weight, b, process_group=group, sequence_parallel=sequence_parallel, **tf)
    if use_module:
        head = ChunkedVocabParallelHead(layer, Chunking(chunk_size, vocab_chunk_size))
        out = head(hidden, labels, **kw)
    else:
        out = linear_log_probs_and_entropy(hidden, layer, labels, chunking=Chunking(chunk_size, vocab_chunk_size), **kw)
    loss = (out.log_probs * g_lp.float()).sum()
    if compute_entropy:
        loss = loss + (out.entropy * g_h.float()).sum()
    if pi2:
        loss = loss + (out.sum_pi_squared * g_q.float()).sum()
    loss.backward()

    what = f"p={p} sp={sequence_parallel} bias={bias} t={'tensor' if torch.is_tensor(temperature) else temperature}"
    assert out.log_probs.shape == labels.shape, what  # the full sequence on every rank
    _close(out.log_probs, lp_ref.detach(), what + " log_probs", rank)
    if compute_entropy:
        _close(out.entropy, ent_ref.detach(), what + " entropy", rank)
    else:
        assert out.entropy is None
    if pi2:
        _close(out.sum_pi_squared, q_ref.detach(), what + " sum_pi_squared", rank)
    assert hidden.grad.shape == hidden.shape
    _close(hidden.grad, h64.grad[seq_rows], what + " grad_hidden", rank)
    _close(weight.grad, w64.grad[rows], what + " grad_weight", rank)
    if bias:
        _close(b.grad, b64.grad[rows], what + " grad_bias", rank)


COMMON = dict(seq=8, batch=3, h=12, v=40)


def _checks(rank, group, seed):
    common = COMMON
    _case(rank, group, **common, bias=True, sequence_parallel=False, temperature=1.0, chunk_size=5, seed=seed)
    _case(rank, group, **common, bias=False, sequence_parallel=False, temperature=0.7, chunk_size=3,
          vocab_chunk_size=3, masked=True, use_module=True, seed=seed + 1)
    _case(rank, group, **common, bias=True, sequence_parallel=True, temperature="per-sample", chunk_size=7,
          seed=seed + 2)
    _case(rank, group, **common, bias=False, sequence_parallel=True, temperature=1.3, chunk_size=4,
          vocab_chunk_size=6, masked=True, use_module=True, seed=seed + 3)
    _case(rank, group, **common, bias=True, sequence_parallel=True, temperature=1.0, chunk_size=64,
          compute_entropy=False, seed=seed + 4)
    _case(rank, group, **common, bias=True, sequence_parallel=True, temperature="per-sample", chunk_size=5,
          vocab_chunk_size=7, seed=seed + 5, tf=dict(softcap=1.5, logit_scale=2.0), pi2=True)


def _tp2(rank, world):
    _checks(rank, dist.group.WORLD, seed=100)
    # With sequence parallelism the labels cover the full sequence: this rank's slice is an error.
    hidden, weight = torch.randn(4, 2, 6), torch.randn(10, 6)
    try:
        linear_log_probs_and_entropy(hidden,
                                     OutputLayer(weight, process_group=dist.group.WORLD, sequence_parallel=True),
                                     torch.zeros(4, 2, dtype=torch.long))
    except ValueError as e:
        assert "sequence_parallel" in str(e) and "(8, 2)" in str(e), str(e)
    else:
        raise AssertionError("a sequence-parallel slice that does not match the labels was accepted")
    # A global id beyond this rank's shard is fine; beyond the global vocabulary (2 x 10) it is an error.
    world_group = dist.group.WORLD
    ok = linear_log_probs_and_entropy(torch.randn(3, 6), OutputLayer(weight, process_group=world_group),
                                      torch.tensor([0, 15, 19]))
    assert ok.log_probs.shape == (3,)
    try:
        linear_log_probs_and_entropy(torch.randn(3, 6), OutputLayer(weight, process_group=world_group),
                                     torch.tensor([0, 20, 1]))
    except ValueError as e:
        assert "labels" in str(e) and "[0, 20)" in str(e), str(e)
    else:
        raise AssertionError("a label id >= V_local * world was accepted")


def _graph_does_not_keep_the_group(rank, world):
    # The graph holds the group weakly (a graph alive at exit must not keep a destroyed
    # group alive into interpreter shutdown); a backward after the group is gone says so.
    import gc
    import weakref

    sub = dist.new_group([0, 1])
    weight = torch.randn(10, 6, requires_grad=True)
    out = linear_log_probs_and_entropy(torch.randn(3, 6), OutputLayer(weight, process_group=sub),
                                       torch.tensor([0, 15, 19]))
    ref = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    assert ref() is None, "the autograd graph kept the destroyed process group alive"
    try:
        out.log_probs.sum().backward()
    except RuntimeError as e:
        assert "destroyed before its backward" in str(e), str(e)
    else:
        raise AssertionError("backward ran without its process group")


def _tp2_graph_and_group(rank, world):
    _tp2(rank, world)
    _graph_does_not_keep_the_group(rank, world)


def _tp4_and_subgroups(rank, world):
    _checks(rank, dist.group.WORLD, seed=200)
    # Two TP groups of 2 inside 4 processes: the group rank, not the global rank, picks the shard.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    _case(rank, group, **COMMON, bias=True, sequence_parallel=False, temperature=0.8, chunk_size=5,
          vocab_chunk_size=7, masked=True, seed=300)
    _case(rank, group, **COMMON, bias=True, sequence_parallel=True, temperature="per-sample", chunk_size=3,
          use_module=True, seed=301)


def test_tensor_parallel_2():
    run_distributed(_tp2_graph_and_group, 2)


def test_tensor_parallel_4_and_subgroups_of_2():
    run_distributed(_tp4_and_subgroups, 4)


def _sp_without_deprecation_warnings(rank, world):
    import warnings

    hidden, weight = torch.randn(2, 1, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates all_gather_into_tensor
        layer = OutputLayer(weight, process_group=dist.group.WORLD, sequence_parallel=True)
        lp, ent = linear_log_probs_and_entropy(hidden, layer, torch.zeros(4, 1, dtype=torch.long))
        (lp.sum() + ent.sum()).backward()


def test_sequence_parallel_collectives_raise_no_deprecation_warning():
    run_distributed(_sp_without_deprecation_warnings, 2)
