"""The invariant mode (``Chunking(invariant=True)``): the same bits at TP 1, 2 and 4, every chunk size and batch.

One spawn of four gloo ranks holds every layout: TP 1 (each rank alone), TP 2 (the groups {0, 1} and {2, 3})
and TP 4 (all four). Every rank builds the same data, computes TP 1's results itself, and holds its results
at TP 2 and TP 4 (and at other chunk sizes, ``rows=`` selections and a row alone) to them with
``torch.equal``: bits, not tolerances. Values and every gradient (logits; hidden states, weight and bias of the
fused head, each rank's gradient the shard of TP 1's), with random upstream gradients on every output
(log-probs, entropy, ``sum_pi_squared``, ``log_probs_at``, ``top_k``), per-row temperatures down to 0.05, a
+1000 logit offset and confident rows, a soft-capped head; float32 and bf16; the fused head under sequence
parallelism and a vocabulary-sharded DTensor's logits (a 1-D mesh of the four ranks) too. The invariant mode's
values and gradients are held
to float64 as every path is (float32 within its rounding). A shard not aligned to the tiles is refused on
every rank of the group, with the rank and what to do.

The compiled kernels (``backend="compile"``) are held to their own bits at every chunk size and in a row alone,
in this process (a compilation in each of four spawned ranks would take a minute on two cores): what they add
to the eager mode is each tile's statistics, a row of the ``[rows * tiles, T]`` view each, whose bits the chunk
size moves if anything does; the merge tree and its gather are the same code at every layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import Chunking, OutputLayer, linear_log_probs_and_entropy, log_probs_and_entropy
from tests.helpers import reference, run_distributed

N, V, H, TILE = 150, 2048, 32, 128
CHUNKS = (1024, 7, 64)  # the logits path; the fused head's chunks are whole row tiles of 128 (a smaller one: 128)
K = 3  # log_probs_at's ids a row, and top_k
SOFTCAP = 30.0  # the fused head's logits are soft-capped (Gemma's final_logit_softcapping)


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, V, generator=g) * 3
    x[::9, 11] += 25.0  # confident rows
    x[3] += 1000.0  # a large offset
    labels = torch.randint(0, V, (N,), generator=g)
    labels[5] = -100
    temp = torch.rand(N, generator=g) + 0.5
    temp[::13] = 0.05
    ids = torch.randint(0, V, (N, K), generator=g)
    h = torch.randn(N, H, generator=g)
    h[4] *= 40.0  # a confident row of the head
    w = torch.randn(V, H, generator=g) / 4
    b = torch.randn(V, generator=g)
    ups = torch.randn(3 + 2 * K, N, generator=g)
    return x.to(dtype), labels, temp, ids, h.to(dtype), w.to(dtype), b.to(dtype), ups


def _loss(o, ups, sel):
    u = ups[:, sel]
    loss = (o.log_probs * u[0]).sum() + (o.entropy * u[1]).sum() + (o.sum_pi_squared * u[2]).sum()
    return loss + (o.log_probs_at * u[3:3 + K].t()).sum() + (o.top_k_log_probs * u[3 + K:].t()).sum()


def _outs(o):
    return [o.log_probs, o.entropy, o.sum_pi_squared, o.log_probs_at, o.top_k_ids, o.top_k_log_probs]


def _logits_call(x, labels, temp, ids, ups, group, cols, chunk, sel=None, backend="auto"):
    xl = x[:, cols].clone().requires_grad_()
    s = slice(None) if sel is None else sel
    o = log_probs_and_entropy(xl, labels[s], layer=OutputLayer(process_group=group), temperature=temp[s],
                              chunking=Chunking(chunk, invariant=True, tile=TILE, backend=backend),
                              compute_sum_pi_squared=True,
                              log_probs_at=ids[s], top_k=K, rows=sel)
    _loss(o, ups, s).backward()
    return [t.detach() for t in _outs(o)], [xl.grad]


def _head_call(h, w, b, labels, temp, ids, ups, group, cols, chunk, sel=None, vocab=None, backend="auto"):
    hh, ww, bb = h.clone().requires_grad_(), w[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()
    s = slice(None) if sel is None else sel
    o = linear_log_probs_and_entropy(
        hh, OutputLayer(ww, bb, softcap=SOFTCAP, process_group=group), labels[s], temperature=temp[s],
        chunking=Chunking(chunk, vocab_chunk_size=vocab, invariant=True, tile=TILE, backend=backend),
        compute_sum_pi_squared=True,
        log_probs_at=ids[s], top_k=K, rows=sel)
    _loss(o, ups, s).backward()
    return [t.detach() for t in _outs(o)], [hh.grad, ww.grad, bb.grad]


def _same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), (
            f"{what}: output {i} differs in {(a != b).sum().item()} of {a.numel()} elements, by up to "
            f"{(a.double() - b.double()).abs().max().item():.3g}")


def _layouts(rank, world):
    """``[(name, group, rank in it, size)]``: TP 1, 2 and 4 as this rank sees them (every rank makes every group)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [("TP 1", None, 0, 1), ("TP 2", pairs[rank // 2], rank % 2, 2), ("TP 4", dist.group.WORLD, rank, 4)]


def _bits_at_every_layout(rank, world):
    layouts = _layouts(rank, world)
    sel = torch.tensor([5, 3, 3, 140, 0, 77])  # a repeat, the offset row, the masked label
    for dtype in (torch.float32, torch.bfloat16):
        x, labels, temp, ids, h, w, b, ups = _data(dtype)
        # TP 1 at the first chunk size: what every other layout must give, bit for bit
        lp_base, lg_base = _logits_call(x, labels, temp, ids, ups, None, slice(None), CHUNKS[0])
        hd_base, hg_base = _head_call(h, w, b, labels, temp, ids, ups, None, slice(None), 128)
        for name, group, r, size in layouts:
            vl = V // size
            cols = slice(r * vl, (r + 1) * vl)
            for chunk in CHUNKS:
                outs, grads = _logits_call(x, labels, temp, ids, ups, group, cols, chunk)
                _same(outs + grads, lp_base + [lg_base[0][:, cols]], f"{dtype} logits {name} chunk {chunk}")
            for chunk, vocab in ((128, None), (256, 2 * TILE), (1024, None)):
                outs, grads = _head_call(h, w, b, labels, temp, ids, ups, group, cols, chunk, vocab=vocab)
                want = hd_base + [hg_base[0], hg_base[1][cols], hg_base[2][cols]]
                _same(outs + grads, want, f"{dtype} fused head {name} chunk {chunk} vocab block {vocab}")
            # rows=: the selected rows' outputs are theirs in the whole batch; a row alone too
            for pick in (sel, torch.tensor([77])):
                outs, grads = _logits_call(x, labels, temp, ids, ups, group, cols, 7, sel=pick)
                _same(outs, [t[pick] for t in lp_base], f"{dtype} logits {name} rows={pick.tolist()}")
                outs, grads = _head_call(h, w, b, labels, temp, ids, ups, group, cols, 128, sel=pick)
                _same(outs, [t[pick] for t in hd_base], f"{dtype} fused head {name} rows={pick.tolist()}")
            if size > 1:  # sequence parallelism: this rank's slice of the hidden states, its slice of TP 1's gradient
                _sequence_parallel(h, w, b, labels, temp, ids, ups, group, r, size, cols, dtype)
            alone_x, alone_h = x[77:78], h[77:78]
            one = slice(77, 78)
            outs, grads = _logits_call(alone_x, labels[one], temp[one], ids[one], ups[:, one], group, cols, 1024)
            _same(outs + grads, [t[one] for t in lp_base] + [lg_base[0][one, cols]], f"{dtype} logits {name} alone")
            outs, grads = _head_call(alone_h, w, b, labels[one], temp[one], ids[one], ups[:, one], group, cols, 128)
            _same(outs + grads[:1], [t[one] for t in hd_base] + [hg_base[0][one]], f"{dtype} head {name} alone")
        if dtype == torch.float32:
            _dtensor_logits(x, labels, temp, ups, rank, world, lp_base)
    # a shard that is not a whole number of tiles: refused on every rank of the group, no rank left waiting
    pair = layouts[1][1]
    x = torch.randn(4, 100)
    with pytest.raises(ValueError, match=r"V_local=100 columns, not a multiple of Chunking.tile=64") as e:
        log_probs_and_entropy(x, torch.zeros(4, dtype=torch.int64), layer=OutputLayer(process_group=pair),
                              chunking=Chunking(invariant=True, tile=64))
    assert "rank 0" in str(e.value) and "rank 1" in str(e.value) and "Pad the vocabulary" in str(e.value)
    wt = torch.randn(100, 8)
    with pytest.raises(ValueError, match=r"not a multiple of Chunking.tile=64"):
        linear_log_probs_and_entropy(torch.randn(4, 8), OutputLayer(wt, process_group=pair),
                                     torch.zeros(4, dtype=torch.int64), chunking=Chunking(invariant=True, tile=64))
    t = torch.ones(1)
    dist.all_reduce(t, group=pair)  # the group is still usable
    assert t.item() == 2


def _dtensor_logits(x, labels, temp, ups, rank, world, lp_base):
    """A vocabulary-sharded DTensor's logits (torchtitan's, a 1-D mesh of the four ranks): TP 1's bits, the
    gradient a DTensor of the logits' placements whose shard is TP 1's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    def call(logits, up):
        o = log_probs_and_entropy(logits, labels, temperature=temp, chunking=Chunking(7, invariant=True, tile=TILE),
                                  compute_sum_pi_squared=True)
        loss = (o.log_probs * up(ups[0])).sum() + (o.entropy * up(ups[1])).sum()
        (loss + (o.sum_pi_squared * up(ups[2])).sum()).backward()
        return o

    xl = x.clone().requires_grad_()
    base = call(xl, lambda t: t)  # TP 1, a plain tensor
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    o = call(d, lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False))
    vl = V // world
    cols = slice(rank * vl, (rank + 1) * vl)
    _same([o.log_probs.to_local(), o.entropy.to_local(), o.sum_pi_squared.to_local(), d.grad.to_local()],
          [base.log_probs, base.entropy, base.sum_pi_squared, xl.grad[:, cols]], "DTensor logits TP 4")
    _same([o.log_probs.to_local()], [lp_base[0]], "DTensor logits TP 4 log-probs")
    assert d.grad.placements == (Shard(1),)


def _sequence_parallel(h, w, b, labels, temp, ids, ups, group, r, size, cols, dtype):
    """The fused head under sequence parallelism (``[S/P, 1, H]`` slices, S = 144 of the rows): the outputs of
    the whole sequence and this rank's slice of the hidden gradient, bitwise TP 1's on the same rows."""
    s, part = 144, 144 // size
    mine = slice(r * part, (r + 1) * part)
    hh = h[mine].unsqueeze(1).clone().requires_grad_()
    ww, bb = w[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()
    o = linear_log_probs_and_entropy(
        hh, OutputLayer(ww, bb, softcap=SOFTCAP, process_group=group, sequence_parallel=True), labels[:s].unsqueeze(1),
        temperature=temp[:s].unsqueeze(1), chunking=Chunking(128, invariant=True, tile=TILE),
        compute_sum_pi_squared=True, log_probs_at=ids[:s].unsqueeze(1), top_k=K)
    u = ups[:, :s]
    loss = (o.log_probs.squeeze(1) * u[0]).sum() + (o.entropy.squeeze(1) * u[1]).sum()
    loss = loss + (o.sum_pi_squared.squeeze(1) * u[2]).sum() + (o.log_probs_at.squeeze(1) * u[3:3 + K].t()).sum()
    (loss + (o.top_k_log_probs.squeeze(1) * u[3 + K:].t()).sum()).backward()
    # TP 1 on the first 144 rows: its own call (the weight's and bias's gradients sum over those rows only)
    base, grads = _head_call(h[:s], w, b, labels[:s], temp[:s], ids[:s], ups[:, :s], None, slice(None), 128)
    _same([t.squeeze(1) for t in _outs(o)], base, f"{dtype} fused head sequence parallel TP {size}")
    _same([hh.grad.squeeze(1), ww.grad, bb.grad], [grads[0][mine], grads[1][cols], grads[2][cols]],
          f"{dtype} fused head sequence parallel TP {size} gradients")


def test_invariant_bits_equal_at_tp_1_2_4_every_chunk_rows_and_batch():
    run_distributed(_bits_at_every_layout, 4, timeout_s=60, deadline_s=300)


def test_invariant_compiled_kernels_same_bits_at_every_chunk_and_batch():
    x, labels, temp, ids, h, w, b, ups = _data(torch.float32)
    lp_base, lg_base = _logits_call(x, labels, temp, ids, ups, None, slice(None), 1024, backend="compile")
    outs, grads = _logits_call(x, labels, temp, ids, ups, None, slice(None), 7, backend="compile")
    _same(outs + grads, lp_base + lg_base, "compiled logits chunk 7")
    sel = torch.tensor([77, 3, 3])  # the rows of another batch: a repeat, the offset row
    outs, _ = _logits_call(x, labels, temp, ids, ups, None, slice(None), 1024, sel=sel, backend="compile")
    _same(outs, [t[sel] for t in lp_base], "compiled logits, rows=")
    hd_base, hg_base = _head_call(h, w, b, labels, temp, ids, ups, None, slice(None), 128, backend="compile")
    outs, grads = _head_call(h, w, b, labels, temp, ids, ups, None, slice(None), 256, vocab=2 * TILE, backend="compile")
    _same(outs + grads, hd_base + hg_base, "compiled fused head chunk 256, vocabulary blocks")


def _head_reference(h, w, b, labels, temp):
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    z = (h64 @ w64.t() + b64)
    lp, ent, s2 = reference(z, labels, temperature=temp, softcap=SOFTCAP, sum_pi_squared=True)
    return (lp, ent, s2), (h64, w64, b64)


def test_invariant_mode_is_exact_against_float64():
    x, labels, temp, ids, h, w, b, ups = _data(torch.float32)
    x64 = x.double().requires_grad_()
    ref = reference(x64, labels, temperature=temp, sum_pi_squared=True)
    sum(r.mul(u.double()).sum() for r, u in zip(ref, ups[:3], strict=True)).backward()
    xl = x.clone().requires_grad_()
    o = log_probs_and_entropy(xl, labels, temperature=temp, chunking=Chunking(7, invariant=True, tile=TILE),
                              compute_sum_pi_squared=True)
    (o.log_probs * ups[0] + o.entropy * ups[1] + o.sum_pi_squared * ups[2]).sum().backward()
    for got, want in zip((o.log_probs, o.entropy, o.sum_pi_squared), ref, strict=True):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(xl.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    (rlp, rent, rs2), leaves = _head_reference(h, w, b, labels, temp)
    (rlp * ups[0].double() + rent * ups[1].double() + rs2 * ups[2].double()).sum().backward()
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    o = linear_log_probs_and_entropy(hh, OutputLayer(ww, bb, softcap=SOFTCAP), labels, temperature=temp,
                                     compute_sum_pi_squared=True,
                                     chunking=Chunking(128, vocab_chunk_size=2 * TILE, invariant=True, tile=TILE))
    (o.log_probs * ups[0] + o.entropy * ups[1] + o.sum_pi_squared * ups[2]).sum().backward()
    for got, want in zip((o.log_probs, o.entropy, o.sum_pi_squared), (rlp, rent, rs2), strict=True):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=5e-5)
    for got, leaf in zip((hh.grad, ww.grad, bb.grad), leaves, strict=True):
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1e-4, atol=1e-4)


def test_invariant_mode_refusals_name_what_to_do():
    with pytest.raises(ValueError, match=r"Chunking.backend='triton' cannot honour Chunking.invariant=True.*"
                                         r"backend='compile'"):
        Chunking(invariant=True, backend="triton")
    with pytest.raises(ValueError, match=r"Chunking.tile must be an int in \[1, 32768\]"):
        Chunking(invariant=True, tile=65536)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"keep= \(sampling replay\) is not available with Chunking\(invariant"):
        log_probs_and_entropy(x, torch.zeros(4, dtype=torch.int64), keep=torch.ones(4, 64, dtype=torch.bool),
                              chunking=Chunking(invariant=True, tile=16))
    from chunked_entropy import policy_loss_from_logits
    with pytest.raises(ValueError, match=r"chunking.invariant=True: this op has no invariant mode"):
        policy_loss_from_logits(x, torch.zeros(4, dtype=torch.int64), torch.zeros(4), torch.zeros(4), torch.ones(4),
                                chunking=Chunking(invariant=True))


def test_torch_cpu_row_reductions_and_exp_depend_on_the_row_alone():
    """What the invariant mode rests on (``chunked_entropy._tiles``): torch's CPU ``max``, ``sum`` along a row of a
    tile's width and its elementwise ``exp`` give bits that depend on the row's values alone, not on the rows
    beside it, their count or where the row sits (one thread and two). If torch changes that, this says so."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, TILE, generator=g) * 7
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            whole = (x.max(dim=1), x.sum(dim=1), torch.exp(x))
            for a, b in ((0, 1), (5, 12), (17, 300), (299, 300)):
                part = x[a:b].clone()
                assert torch.equal(part.max(dim=1).values, whole[0].values[a:b])
                assert torch.equal(part.max(dim=1).indices, whole[0].indices[a:b])
                assert torch.equal(part.sum(dim=1), whole[1][a:b])
                assert torch.equal(torch.exp(part), whole[2][a:b])
                flat = slice(a * TILE + 3, b * TILE)  # a start off the vector width
                assert torch.equal(torch.exp(x.view(-1)[flat]), whole[2].view(-1)[flat])
    finally:
        torch.set_num_threads(threads)
