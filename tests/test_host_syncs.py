"""Host synchronisation: one per call (its value checks), none per chunk; bad input refused before any
index reads it.

On a GPU, reading a device value on the host (``.item()``, ``bool(t)``,
``.tolist()``), ``nonzero``, boolean-mask indexing, ``masked_select``,
``repeat_interleave`` without an output size and ``unique`` stall the host
until the device catches up. Each path may do a few per call (its checks, the
kept sets' layout, a scalar upstream gradient); none may do one per chunk or
per vocabulary block. Counted here on the CPU, at the dispatcher, where the
same ops run (and ``Tensor.tolist``, which reads without dispatching): the
count with 1, 2 and 8 chunks (and vocabulary blocks) must be the same, and
small; without ``keep=`` (its layout is read once per call) and the
``clip_cov``/``kl_cov`` objectives (which pick a data-dependent number of
tokens, as verl's do), it is exactly the one read of the call's value checks
(zero with ``CHUNKED_ENTROPY_CHECKS=async``).

A bad value (a label out of range, a NaN temperature, ...) must be refused
by that one read, before any index, gather or scatter reads it: on a GPU such
an op trips a device-side assert first, and the CUDA context is lost. Traced
here with a dispatch mode that follows every tensor computed from the bad
input.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import partial

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from chunked_entropy import (
    ChunkedVocabParallelHead,
    Chunking,
    OutputLayer,
    PolicyLoss,
    divergence_from_logits,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    losses,
    policy_loss_from_logits,
)
from chunked_entropy._checks import CHECKS_ENV

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
           aten.masked_select, aten.repeat_interleave, aten.unique_consecutive, aten._unique2, aten.unique_dim}


class _HostSyncs(TorchDispatchMode):
    """Counts the dispatched ops that wait for the device (boolean-mask indexing among them), and the
    ``Tensor.tolist`` calls (a read of the device that dispatches nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self._reads = _Reads(self.ops)

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _sync_name(func, args, kwargs or {})
        if name:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.ops["Tensor.tolist"] += 1
        return func(*args, **(kwargs or {}))


def _sync_name(func, args, kwargs):
    """The name of a dispatched op that waits for the device, else None."""
    op = func.overloadpacket
    if op is aten.index and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
        return "index by a bool mask"
    if op is aten.repeat_interleave and kwargs.get("output_size", args[-1] if len(args) > 2 else None) is not None:
        return None  # its output size given: no read
    return str(op) if op in SYNCING else None


B, T, H, V = 4, 16, 8, 64
N = B * T


def _data():
    g = torch.Generator().manual_seed(0)
    d = dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g),
             labels=torch.randint(0, V, (B, T), generator=g), old=torch.randn(B, T, generator=g) - 4,
             adv=torch.randn(B, T, generator=g), mask=torch.rand(B, T, generator=g) > 0.2,
             temperature=torch.rand(B, T, generator=g) + 0.5, teacher=torch.randint(0, V, (B, T, 5), generator=g))
    d["keep"] = (torch.randint(0, V, (N * 3,), generator=g), torch.arange(0, N * 3 + 1, 3))
    return d


def _outputs_step(d, chunk, *, head, **kw):
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    if head:
        out = linear_log_probs_and_entropy(h, w, d["labels"], **{"chunking": chunk, **kw})
    else:
        out = log_probs_and_entropy(h @ w.t(), d["labels"], **{"chunking": chunk, **kw})
    total = sum(t.sum() for t in (out.log_probs, out.entropy, out.log_probs_at, out.top_k_log_probs)
                if t is not None)
    total.backward()


def _loss_step(d, chunk, *, head, mode, options=(), batch=(), **kw):
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    args = (d["labels"], d["old"], d["adv"], d["mask"])
    options = dict(options, dro_beta=0.2 if mode == "dro" else None)
    common = dict(chunking=chunk, loss=PolicyLoss(mode, options, entropy_coeff=0.01).for_batch(**dict(batch)), **kw)
    if head:
        loss, _ = linear_policy_loss(h, w, *args, **common)
    else:
        loss, _ = policy_loss_from_logits(h @ w.t(), *args, **common)
    (loss * 0.5).backward()


def _plain_loss_step(d, mode, weighted=False):
    lp = torch.randn(B, T, generator=torch.Generator().manual_seed(1)).sub(3).requires_grad_()
    mask = d["mask"].to(torch.float32) * 0.5 if weighted else d["mask"]
    kw = dict(rollout_is="token") if mode == "bypass_mode" else {}
    loss, _ = losses.policy_loss(lp, d["old"], d["adv"], mask, PolicyLoss(mode, kw))
    loss.backward()


def _divergence_step(d, chunk, *, form, **kw):
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    th, tw = d["hidden"].flip(0), d["weight"] * 0.5
    if form == "head":
        out = linear_divergence(h, w, th, tw, labels=d["labels"], compute_entropy=True, chunking=chunk, **kw)
        (out.divergence.sum() + out.log_probs.sum() + out.entropy.sum()).backward()
    elif form == "loss":
        linear_divergence_loss(h, w, th, tw, chunking=chunk, label_mask=d["mask"], **kw).loss.backward()
    else:
        z = h @ w.t()
        out = divergence_from_logits(z, th @ tw.t(), labels=d["labels"], chunking=chunk, **kw)
        (out.divergence.sum() + out.log_probs.sum()).backward()


def _module_step(d, chunk):
    head = ChunkedVocabParallelHead(d["weight"].clone().requires_grad_(), chunk)
    out = head(d["hidden"].clone().requires_grad_(), d["labels"])
    (out.log_probs.sum() + out.entropy.sum()).backward()


CASES = {
    "logits": lambda d, c: _outputs_step(d, c, head=False),
    "logits, temperatures, softcap": lambda d, c: _outputs_step(d, c, head=False, temperature=d["temperature"],
                                                                layer=OutputLayer(softcap=5.0)),
    "logits, keep": lambda d, c: _outputs_step(d, c, head=False, keep=d["keep"]),
    "logits, log_probs_at, top_k": lambda d, c: _outputs_step(d, c, head=False, log_probs_at=d["teacher"], top_k=4),
    "head": lambda d, c: _outputs_step(d, c, head=True),
    "head, vocabulary blocks": lambda d, c: _outputs_step(d, c, head=True, chunking=Chunking(c, max(c // 2, 1))),
    "head, keep": lambda d, c: _outputs_step(d, c, head=True, keep=d["keep"]),
    "head, log_probs_at, top_k": lambda d, c: _outputs_step(d, c, head=True, log_probs_at=d["teacher"], top_k=4),
    "the module": _module_step,
    **{f"fused loss, {m}": partial(_loss_step, head=True, mode=m) for m in losses.LOSS_MODES},
    "fused loss from logits, gspo": lambda d, c: _loss_step(d, c, head=False, mode="gspo"),
    "fused loss, keep": lambda d, c: _loss_step(d, c, head=True, mode="vanilla", keep=d["keep"]),
    "fused loss, rollout log-probs": lambda d, c: _loss_step(d, c, head=True, mode="vanilla",
                                                             rollout_log_probs=d["old"] - 0.1,
                                                             options={"rollout_is": "token"}),
    "fused loss, global token count": lambda d, c: _loss_step(d, c, head=True, mode="vanilla", batch=dict(
        dp_size=2, batch_num_tokens=torch.tensor(100.0))),
    "policy_loss, bypass_mode": lambda d, c: _plain_loss_step(d, "bypass_mode"),
    "policy_loss, vanilla, weights": lambda d, c: _plain_loss_step(d, "vanilla", weighted=True),
    "divergence": lambda d, c: _divergence_step(d, c, form="head"),
    "divergence loss": lambda d, c: _divergence_step(d, c, form="loss"),
    "divergence from logits": lambda d, c: _divergence_step(d, c, form="logits"),
}

#: Paths whose reads follow the data beyond the one check: the kept sets' layout (one read per call) and
#: the objectives that pick a data-dependent number of tokens (``nonzero``, as verl's).
LAYOUT_READS = ("keep", "clip_cov", "kl_cov")


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_syncs_do_not_grow_with_the_chunks(case):
    d = _data()
    counts = {}
    for chunk in (N, N // 2, N // 8):  # 1, 2 and 8 chunks; with T = 16 rows fit the first two, not the last
        with _HostSyncs() as s:
            CASES[case](d, chunk)
        counts[chunk] = s.ops
    assert counts[N] == counts[N // 2] == counts[N // 8], counts
    assert sum(counts[N].values()) <= 8, counts[N]


@pytest.mark.parametrize("case", sorted(c for c in CASES if not any(k in c for k in LAYOUT_READS)))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_host_sync_per_call(case, mode, monkeypatch):
    """Forward and backward read the device once: the call's value checks, folded into one boolean
    (``"async"``: none, each check a device-side assertion)."""
    monkeypatch.setenv(CHECKS_ENV, mode)
    with _HostSyncs() as s:
        CASES[case](_data(), N // 2)
    assert sum(s.ops.values()) == (1 if mode == "sync" else 0), s.ops


# ----------------------------------------------------------------------------- bad input: refused before it is read

#: Ops that read memory at positions given by a tensor: on a GPU an out-of-range position is a device-side
#: assert. Each with where its positions are (an argument index; a list of them for ``index``/``index_put``).
INDEXING = {aten.index: 1, aten._unsafe_index: 1, aten.index_put: 1, aten._index_put_impl_: 1, aten.gather: 2,
            aten.scatter: 2, aten.scatter_add: 2, aten.scatter_reduce: 2, aten.index_select: 2, aten.index_add: 2,
            aten.index_copy: 2, aten.index_fill: 2, aten.embedding: 1, aten.take: 1, aten.put: 1,
            aten.one_hot: 0, aten.repeat_interleave: 0, aten.bincount: 0}


class _Taint(TorchDispatchMode):
    """Follows every tensor computed from ``bad`` (by storage: views and in-place writes included) and
    records, in order, the host reads and the indexing ops whose positions come from it."""

    def __init__(self, *bad):
        super().__init__()
        self.ptrs, self.alive, self.log = set(), list(bad), []  # alive: no freed storage is reused meanwhile
        for t in bad:
            self.ptrs.add(t.untyped_storage().data_ptr())

    def _tainted(self, t):
        return isinstance(t, torch.Tensor) and t.numel() > 0 and t.untyped_storage().data_ptr() in self.ptrs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _sync_name(func, args, kwargs):
            self.log.append(("sync", str(func)))
        at = INDEXING.get(func.overloadpacket)
        if at is not None and at < len(args) and any(self._tainted(t) for t in tree_leaves(args[at])):
            self.log.append(("index", str(func)))
        out = func(*args, **kwargs)
        if any(self._tainted(t) for t in tree_leaves((args, kwargs))):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > 0:
                    self.ptrs.add(t.untyped_storage().data_ptr())
                    self.alive.append(t)
        return out


def _bad_labels(value):
    def make(d):
        labels = d["labels"].clone()
        labels.view(-1)[int(d["mask"].view(-1).nonzero()[3, 0])] = value  # a token the losses' mask counts
        return dict(labels=labels), labels
    return make


def _bad_temperature(d):
    t = d["temperature"].clone()
    t[2, 5] = math.nan
    return dict(temperature=t), t


def _bad_log_probs_at(d):
    ids = d["teacher"].clone()
    ids[0, 7, 2] = V + 5
    return dict(log_probs_at=ids), ids


def _bad_keep_ids(d):
    ids, offsets = (t.clone() for t in d["keep"])
    ids[10] = V + 1
    return dict(keep=(ids, offsets)), ids


def _bad_keep_offsets(d):
    ids, offsets = (t.clone() for t in d["keep"])
    offsets[5] = offsets[6] + 4  # decreases after it
    return dict(keep=(ids, offsets)), offsets


def _bad_mask(d):
    m = d["mask"].to(torch.float32)
    m[3, 1] = -1.0
    return dict(loss_mask=m), m


def _bad_count(d):
    c = torch.tensor(0.0)
    return dict(dp_size=2, batch_num_tokens=c), c


def _bad_teacher(d):
    th = d["hidden"].flip(0).clone()
    th[1, 2, 3] = math.nan
    return dict(teacher_hidden=th), th


def _run_outputs(op, d, kw):
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    args = dict(labels=d["labels"], chunking=N // 2)
    args.update(kw)
    if op == "head":
        return linear_log_probs_and_entropy(h, w, args.pop("labels"), **args)
    if op == "module":
        return ChunkedVocabParallelHead(w, N // 2)(h, args.pop("labels"), **{
            k: v for k, v in args.items() if k != "chunking"})
    return log_probs_and_entropy(h @ w.t(), args.pop("labels"), **args)


def _run_loss(op, d, kw):
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    args = dict(labels=d["labels"], old_log_probs=d["old"], advantages=d["adv"], loss_mask=d["mask"])
    args.update(kw)
    pos = [args.pop(k) for k in ("labels", "old_log_probs", "advantages", "loss_mask")]
    # the global counts ride in the PolicyLoss
    args["loss"] = PolicyLoss().for_batch(**{k: args.pop(k) for k in ("dp_size", "batch_num_tokens") if k in args})
    if op == "linear_policy_loss":
        return linear_policy_loss(h, w, *pos, chunking=N // 2, **args)
    if op == "policy_loss_from_logits":
        return policy_loss_from_logits(h @ w.t(), *pos, chunking=N // 2, **args)
    lp = torch.randn(B, T).sub(3).requires_grad_()  # losses.policy_loss: no labels
    return losses.policy_loss(lp, *pos[1:], **args)


def _run_divergence(op, d, kw):
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    th = kw.pop("teacher_hidden", d["hidden"].flip(0))
    args = dict(labels=d["labels"], chunking=N // 2)
    args.update(kw)
    if op == "linear_divergence":
        return linear_divergence(h, w, th, d["weight"] * 0.5, **args)
    if op == "linear_divergence_loss":
        if "labels" in kw:
            args["label_mask"] = args.pop("labels") >= 0  # the loss form takes no labels
        else:
            args.pop("labels")
        return linear_divergence_loss(h, w, th, d["weight"] * 0.5, **args)
    return divergence_from_logits(h @ w.t(), th @ (d["weight"] * 0.5).t(), **args)


OUTPUT_OPS = ("log_probs_and_entropy", "head", "module")
LOSS_OPS = ("linear_policy_loss", "policy_loss_from_logits")
DIVERGENCE_OPS = ("linear_divergence", "divergence_from_logits")
BAD = [(op, what, make, match) for op in OUTPUT_OPS + LOSS_OPS + DIVERGENCE_OPS for what, make, match in (
    ("label out of range", _bad_labels(V + 3), "labels must be vocabulary ids"),
    ("negative label", _bad_labels(-5), "labels must be vocabulary ids"),
    ("NaN temperature", _bad_temperature, "temperature must be finite"),
)] + [(op, what, make, match) for op in OUTPUT_OPS for what, make, match in (
    ("log_probs_at id out of range", _bad_log_probs_at, "log_probs_at must hold vocabulary ids"),
)] + [(op, what, make, match) for op in OUTPUT_OPS + LOSS_OPS for what, make, match in (
    ("keep id out of range", _bad_keep_ids, "keep's token_ids must be vocabulary ids"),
    ("keep offsets decreasing", _bad_keep_offsets, "keep's offsets must start at 0"),
)] + [(op, what, make, match) for op in LOSS_OPS + ("losses.policy_loss",) for what, make, match in (
    ("negative loss_mask weight", _bad_mask, "loss_mask must be bool or hold finite weights >= 0"),
    ("zero batch_num_tokens", _bad_count, "batch_num_tokens must be a finite number > 0"),
)] + [(op, "NaN teacher", _bad_teacher, "teacher_hidden must be finite")
      for op in ("linear_divergence", "linear_divergence_loss")]


@pytest.mark.parametrize("op, what, make, match", BAD, ids=[f"{op}: {what}" for op, what, *_ in BAD])
def test_bad_input_is_refused_by_the_one_read_before_any_index_reads_it(op, what, make, match):
    d = _data()
    kw, bad = make(d)
    run = (_run_outputs if op in OUTPUT_OPS else _run_divergence if op in DIVERGENCE_OPS + (
        "linear_divergence_loss",) else _run_loss)
    with _Taint(bad) as log, pytest.raises(ValueError, match=match):
        run(op, d, kw)
    first_sync = next((i for i, (kind, _) in enumerate(log.log) if kind == "sync"), None)
    assert first_sync is not None, log.log  # refused by the call's read, not by an op that failed on the CPU
    assert [name for kind, name in log.log[:first_sync] if kind == "index"] == [], log.log


@pytest.mark.parametrize("op, what, make, match", BAD[:4], ids=[f"{op}: {what}" for op, what, *_ in BAD[:4]])
def test_async_checks_assert_on_the_device_instead(op, what, make, match, monkeypatch):
    """``CHUNKED_ENTROPY_CHECKS=async``: no read; the device-side assertion fails (on the CPU: at once)."""
    monkeypatch.setenv(CHECKS_ENV, "async")
    d = _data()
    kw, _ = make(d)
    with _HostSyncs() as s, pytest.raises(RuntimeError, match=match):
        _run_outputs(op, d, kw)
    assert sum(s.ops.values()) == 0, s.ops


def test_the_checks_setting_is_checked(monkeypatch):
    monkeypatch.setenv(CHECKS_ENV, "later")
    with pytest.raises(ValueError, match=f"{CHECKS_ENV} must be 'sync'"):
        log_probs_and_entropy(torch.randn(2, 5), torch.tensor([1, 2]))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_adapters_value_checks_follow_the_setting(mode, monkeypatch):
    """TRL's ids and verl's per-sample temperatures: a ValueError naming them (one read), or the assertion."""
    from chunked_entropy.integrations._common import check_id_range
    from chunked_entropy.integrations.verl.fsdp import _check_temperature

    monkeypatch.setenv(CHECKS_ENV, mode)
    err = ValueError if mode == "sync" else RuntimeError
    with _HostSyncs() as s, pytest.raises(err, match="index must hold class ids in \\[0, 8\\)"):
        check_id_range("index", torch.tensor([[1, 8]]), 8)
    if mode == "async":
        assert sum(s.ops.values()) == 0, s.ops
    with pytest.raises(err, match='micro_batch\\["temperature"\\] must be finite and > 0'):
        _check_temperature(torch.tensor([1.0, math.nan]))
    if mode == "sync":
        with pytest.raises(ValueError, match="found 8 at flat position 1"):
            check_id_range("index", torch.tensor([[1, 8]]), 8)
        with pytest.raises(ValueError, match="sample 1 has nan"):
            _check_temperature(torch.tensor([1.0, math.nan]))
