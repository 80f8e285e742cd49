"""Property: any argument of any op, changed on one rank of a process group, fails fast on every rank.

The arguments are enumerated from each op's signature (``inspect.signature``), and the fields of the
option objects it takes (``OutputLayer``, ``Chunking``, ``PolicyLoss`` with its ``Aggregation`` and
``PolicyOptions``, ``Divergence``) from their dataclass fields, so a parameter or field added later is
covered without a new line here: its value in the base call is changed by its type (a tensor gets one
element changed, a number is scaled, a flag flipped, an option string swapped for another; a bad value
is a tensor of the wrong shape, a NaN, an object of the wrong type). A field's bad value cannot reach
an op (the object refuses it where it is built); the object itself is replaced by one of the wrong
type instead. On rank 1 only:

- a bad value: every rank raises the same ``ValueError`` / ``TypeError``, naming rank 1;
- a different valid value: every rank raises the same error, naming rank 1, except for the arguments
  that are each rank's own by contract (:data:`PER_RANK`, each with its reason): then no rank raises
  and every rank's outputs are bit-equal.

Every op is also called with ``rows=`` (an index, and ``"kept"`` / ``("kept", count)`` on the ops over
hidden states), every argument varied as above, and ``rows`` itself wrong on one rank only (a misspelled
``"kep"``, ``"kept"`` from logits, a 1-D index for the policy losses, a count above the rows or above
``T``, no labels or labels of another shape, a 1-D ``loss_mask``, no ``rows`` at all): a refusal before
the op's agreed call (reading ``rows``, building the kept rows) still reaches every rank.

Each scenario runs in a real gloo group of two and of three ranks whose collective timeout is 20 s (a rank
left waiting in a collective fails the test instead of hanging it; the spawn itself is bounded too), must
finish in seconds, and is followed by one all-gather of what each rank got (raised or not, a digest of its
outputs or error message) that must bring every rank's row in rank order: the group stays usable. The
messages themselves are gathered only where a scenario failed. One spawn per world size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import re
import time

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    Chunking,
    Divergence,
    OutputLayer,
    PolicyLoss,
    divergence_from_logits,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from chunked_entropy.losses import Aggregation, PolicyOptions
from tests.helpers import run_distributed

B, T, H, V_LOCAL, WORLD = 2, 3, 4, 6, 2
V = V_LOCAL * WORLD  # the ids' range: the vocabulary at two ranks (within it at three)
#: The world sizes every scenario runs at.
WORLDS = (2, 3)

#: Arguments each rank passes its own value of, by contract: a different value on one rank is no error,
#: and every rank's outputs must still be bit-equal.
PER_RANK = {
    "weight": "this rank's vocabulary shard",
    "student_weight": "this rank's vocabulary shard",
    "teacher_weight": "this rank's vocabulary shard",
    "bias": "this rank's vocabulary shard",
    "student_bias": "this rank's vocabulary shard",
    "teacher_bias": "this rank's vocabulary shard",
    "logits": "this rank's vocabulary shard",
    "student_logits": "this rank's vocabulary shard",
    "teacher_logits": "this rank's vocabulary shard",
    "gradient_accumulation_fusion": "where this rank's weight gradient goes (main_grad or .grad): no collective",
    # Replicated by contract but not compared: a fingerprint would read all [T, H] values per call.
    "hidden": "replicated by contract, not fingerprinted (a pass over [T, H] per call)",
    "student_hidden": "replicated by contract, not fingerprinted (a pass over [T, H] per call)",
    "teacher_hidden": "replicated by contract, not fingerprinted (a pass over [T, H] per call)",
}

#: Arguments (and option fields) whose different value is not tried, with the reason.
NOT_VARIED = {
    "backend": "a kernel choice per rank (same collectives, outputs equal to rounding); compiling costs a minute",
    "generator": "an object without a value to change (clip_cov's draw is fingerprinted: test_policy_modes)",
    "process_group": "the group itself",
}

#: The option objects whose fields are varied one by one (nested: a PolicyLoss's aggregation and options).
OPTIONS = (OutputLayer, Chunking, PolicyLoss, Divergence, Aggregation, PolicyOptions)

#: Another valid value of an option string (keyed by the value).
OTHER = {"forward_kl": "reverse_kl", "reverse_kl": "jsd", "mean": "sum", "sum": "mean", "full": "kept",
         "kept": "full", "token-mean": "token-sum", "vanilla": "gspo", "low_var_kl": "k3", "eager": "eager"}


def _data(rank, world=WORLD):
    g = torch.Generator().manual_seed(0)
    v = V_LOCAL * world
    full_logits = torch.randn(B, T, v, generator=g) * 2
    full_w, full_tw = torch.randn(v, H, generator=g), torch.randn(v, H + 1, generator=g)
    full_b = torch.randn(v, generator=g)
    s = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    return dict(
        logits=full_logits[..., s].contiguous(), teacher_logits=(full_logits * 0.7 + 0.1)[..., s].contiguous(),
        hidden=torch.randn(B, T, H, generator=g), teacher_hidden=torch.randn(B, T, H + 1, generator=g),
        weight=full_w[s].clone(), teacher_weight=full_tw[s].clone(), bias=full_b[s].clone(),
        labels=torch.randint(0, V, (B, T), generator=g), ids=torch.randint(0, V, (B, T, 2), generator=g),
        temperature=torch.rand(B, T, generator=g) + 0.5, mask=torch.tensor([[True, True, False], [True] * 3]),
        old=-torch.rand(B, T, generator=g) - 1, adv=torch.randn(B, T, generator=g),
        ref=-torch.rand(B, T, generator=g) - 1, weights=torch.rand(B, T, generator=g) + 0.5,
        keep=(torch.tensor([0, 3, 5, 1, 2, 7, 9, 11, 4, 6]), torch.tensor([0, 2, 3, 5, 7, 8, 10])),
    )


def _bases(op, d):
    """Base calls of ``op``: every argument and option field set (to a non-default value where that makes
    sense), then the first of them with ``rows`` (:func:`_rows_bases`)."""
    bases = _plain_bases(op, d)
    return bases + _rows_bases(op, bases[0])


#: The per-token inputs of the ops (beside the tokens themselves: hidden, logits), of leading shape [B, T].
PER_TOKEN = ("labels", "label_mask", "temperature", "log_probs_at", "old_log_probs", "advantages", "loss_mask",
             "ref_log_probs", "rollout_is_weights", "rollout_log_probs", "weights", "teacher_hidden",
             "teacher_logits")
#: A [M] index into the B * T = 6 token rows (repeats and gaps), and the policy losses' [B', T'] one.
INDEX, INDEX_2D = torch.tensor([4, 0, 0, 5]), torch.tensor([[0, 2, 4], [1, 3, 3]])
HIDDEN_OPS = (linear_log_probs_and_entropy, linear_policy_loss, linear_divergence, linear_divergence_loss)
POLICY_OPS = (linear_policy_loss, policy_loss_from_logits)


def _keep_at(keep, flat):
    """Sampling replay's kept sets ``(token_ids, offsets)`` of the flat token rows ``flat``, packed anew."""
    ids, offsets = keep
    sets = [ids[offsets[i]:offsets[i + 1]] for i in flat.tolist()]
    return torch.cat(sets), torch.tensor([0] + [len(x) for x in sets]).cumsum(0)


def _rows_bases(op, base):
    """``base`` with ``rows``: an index (every per-token input given per selected row), and on the ops over
    hidden states ``"kept"`` and ``("kept", count)`` (inputs in their full shape)."""
    index = INDEX_2D if op in POLICY_OPS else INDEX
    flat = index.reshape(-1)
    at = dict(base, rows=index)
    for k in PER_TOKEN:
        x = base.get(k)
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            at[k] = x.reshape(B * T, *x.shape[2:])[flat].view(*index.shape, *x.shape[2:])
    if isinstance(base.get("keep"), tuple):
        at["keep"] = _keep_at(base["keep"], flat)
    if op not in HIDDEN_OPS:
        return [at]
    if op is linear_policy_loss:  # the rows of each sequence that loss_mask keeps
        count = int((base["loss_mask"] != 0).sum(1).max())
    else:
        valid = base["label_mask"].clone()
        if base.get("labels") is not None:
            valid &= base["labels"] != base.get("ignore_index", -100)
        count = int(valid.sum())
    return [at, dict(base, rows="kept"), dict(base, rows=("kept", count))]


def _rows_cases(op, base):
    """``(what, kwargs)``: ``rows`` (and what ``rows="kept"`` reads) wrong on one rank only."""
    rows = base.get("rows")
    cases = [("rows = 'kep'", dict(base, rows="kep")), ("rows = ('kept',)", dict(base, rows=("kept",))),
             ("rows = ('kept', -1)", dict(base, rows=("kept", -1))),
             ("rows = ('kept', 10**3), above the rows", dict(base, rows=("kept", 10**3))),
             ("rows = a 0-d tensor", dict(base, rows=torch.tensor(0))),
             ("rows = a float tensor", dict(base, rows=torch.tensor([0.5]))),
             ("rows = a bool tensor", dict(base, rows=torch.ones(B * T, dtype=torch.bool))),
             ("rows = an index out of range", dict(base, rows=torch.tensor([0, 99]))),
             ("rows = an index of another row", dict(base, rows=torch.tensor([1, 2])))]
    if not isinstance(rows, (str, tuple)):  # ("kept", count) and "kept" are the same call
        cases.append(("rows = 'kept'", dict(base, rows="kept")))
    if rows is not None:
        cases.append(("rows = None", dict(base, rows=None)))
    if op in POLICY_OPS:
        cases.append(("rows = a 1-D index", dict(base, rows=INDEX)))
    if op is linear_policy_loss:
        cases.append(("rows = ('kept', T + 1), above T", dict(base, rows=("kept", T + 1))))
    if isinstance(rows, (str, tuple)):  # what "kept" reads
        if isinstance(rows, tuple):
            cases.append(("rows = ('kept', count + 1), another count", dict(base, rows=("kept", rows[1] + 1))))
        if "labels" in base:
            cases += [("labels = None", dict(base, labels=None)),
                      ("labels of another shape", dict(base, labels=base["labels"][:, :-1]))]
        for k in ("label_mask", "loss_mask"):
            if k in base:
                cases.append((f"{k} 1-D", dict(base, **{k: base[k].reshape(-1)})))
    return cases


def _plain_bases(op, d):
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731 - half weights, so that logits_dtype changes something
    group = dist.group.WORLD
    common = dict(temperature=d["temperature"])
    if op is log_probs_and_entropy:
        base = dict(logits=d["logits"], labels=d["labels"], compute_entropy=True, label_mask=d["mask"],
                    ignore_index=int(d["labels"][1, 2]), compute_sum_pi_squared=True,
                    layer=OutputLayer(softcap=30.0, logit_scale=1.3, process_group=group),
                    chunking=Chunking(4, backend="eager"), **common)
        return [dict(base, log_probs_at=d["ids"], top_k=3, entropy_of="full"),
                dict(base, keep=d["keep"], entropy_of="kept")]
    layer = OutputLayer(bf(d["weight"]), bf(d["bias"]), softcap=30.0, logit_scale=1.3, logits_dtype=torch.float32,
                        process_group=group, sequence_parallel=False, gradient_accumulation_fusion=False)
    if op is linear_log_probs_and_entropy:
        base = dict(hidden=bf(d["hidden"]), layer=layer, labels=d["labels"], compute_entropy=True,
                    label_mask=d["mask"], ignore_index=int(d["labels"][1, 2]), compute_sum_pi_squared=True,
                    chunking=Chunking(4, 4, "eager"), **common)
        return [dict(base, log_probs_at=d["ids"], top_k=3, entropy_of="full"),
                dict(base, keep=d["keep"], entropy_of="kept")]
    loss = PolicyLoss("vanilla", entropy_coeff=0.01, kl_coef=0.1, kl_kind="low_var_kl", entropy_of="full",
                      aggregation=Aggregation("token-mean", 2.0, dp_size=1))
    norm = loss.replace(aggregation=Aggregation("seq-mean-token-sum-norm", 2.0, 1, batch_num_tokens=8,
                                                global_batch_size=4))
    policy = dict(labels=d["labels"], old_log_probs=d["old"], advantages=d["adv"], loss_mask=d["mask"].float(),
                  ref_log_probs=d["ref"], rollout_is_weights=d["weights"], keep=d["keep"], loss=loss, **common)
    if op is linear_policy_loss:
        base = dict(hidden=bf(d["hidden"]), layer=layer, chunking=Chunking(4, 4, "eager"), **policy)
        return [base, dict(base, rollout_is_weights=None, rollout_log_probs=d["old"] - 0.1, keep=None, loss=norm)]
    if op is policy_loss_from_logits:
        base = dict(logits=d["logits"], layer=OutputLayer(softcap=30.0, logit_scale=1.3, process_group=group),
                    chunking=Chunking(4, backend="eager"), **policy)
        return [base, dict(base, rollout_is_weights=None, rollout_log_probs=d["old"] - 0.1, keep=None, loss=norm)]
    two = dict(label_mask=d["mask"], compute_entropy=True, **common)
    heads = dict(student_hidden=bf(d["hidden"]), teacher_hidden=d["teacher_hidden"],
                 student_layer=OutputLayer(bf(d["weight"]), bf(d["bias"]), softcap=30.0, logit_scale=1.3,
                                           logits_dtype=torch.float32, process_group=group, sequence_parallel=False),
                 teacher_layer=OutputLayer(d["teacher_weight"], d["bias"] * 0.5, softcap=20.0, logit_scale=0.9,
                                           logits_dtype=torch.float32, process_group=group, sequence_parallel=False),
                 chunking=Chunking(4, 4), **two)
    if op is linear_divergence:
        return [dict(heads, divergence=Divergence("jsd", 0.3), labels=d["labels"],
                     ignore_index=int(d["labels"][1, 2]))]
    if op is linear_divergence_loss:
        return [dict(heads, divergence=Divergence("forward_kl"), reduction="sum", normalizer=5.0, weights=d["weights"]),
                dict(heads, divergence=Divergence("jsd", 0.3), reduction="mean", normalizer=torch.tensor(5.0))]
    if op is divergence_from_logits:
        return [dict(student_logits=d["logits"], teacher_logits=d["teacher_logits"], divergence=Divergence("jsd", 0.3),
                     labels=d["labels"], ignore_index=int(d["labels"][1, 2]), chunking=Chunking(4),
                     student_layer=OutputLayer(softcap=30.0, logit_scale=1.3, process_group=group),
                     teacher_layer=OutputLayer(softcap=20.0, logit_scale=0.9, process_group=group), **two)]
    raise AssertionError(op)


def _fields(obj, path=()):
    """``(path, value)`` of every field of an option object, nested objects' fields included."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, OPTIONS):
            yield from _fields(value, path + (f.name,))
        else:
            yield path + (f.name,), value


def _replace(obj, path, value):
    """``obj`` with the field at ``path`` set to ``value`` (each object on the way checked again)."""
    inner = value if len(path) == 1 else _replace(getattr(obj, path[0]), path[1:], value)
    return dataclasses.replace(obj, **{path[0]: inner})


def _different(value):
    """Another valid value of the same kind, or None where there is none to make."""
    if isinstance(value, torch.Tensor):
        t = value.clone()
        flat = t.view(-1)
        if t.dtype == torch.bool:
            flat[0] = ~flat[0]
        elif t.is_floating_point():
            flat[0] += 0.25
        else:  # ids
            flat[0] = (flat[0] + 1) % V
        return t
    if isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):  # CSR (ids, offsets)
        return (_different(value[0]),) + value[1:]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.25 if value else 0.5
    if isinstance(value, str):
        return OTHER.get(value)
    if isinstance(value, torch.dtype):
        return None
    return None


def _bad(value):
    """Values that must be refused: a tensor of the wrong shape, a NaN, something of the wrong type."""
    if isinstance(value, torch.Tensor):
        return [value[..., :-1] if value.dim() and value.shape[-1] > 1 else value.unsqueeze(-1).expand(
            *value.shape, 2)]
    if isinstance(value, tuple):
        return [(value[0], value[1][:-1])]
    if isinstance(value, bool):
        return ["yes"]
    if isinstance(value, (int, float)):
        return [math.nan, "x"]
    return [object()]


def _flat(out):
    """Every tensor of an op's result, in order (named tuples, tuples, dicts of metrics)."""
    if isinstance(out, torch.Tensor):
        return [out.detach()]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _flat(x)]
    return [torch.as_tensor(out)] if isinstance(out, (int, float)) else []


def _run(fn, kw):
    try:
        out = fn(**kw)
    except (ValueError, TypeError) as e:
        return ("raised", type(e).__name__, str(e))
    flat = _flat(out) + _flat([getattr(out, k, None) for k in ("sum_pi_squared", "log_probs_at", "top_k_log_probs")
                                if getattr(out, k, None) is not None])
    return ("ok", [t.double().tolist() for t in flat])


def _scenarios(op, d, rank, wrong_type_objects=False):
    """``(what, kind, name, argument, kwargs)`` for rank 1's changed calls (rank 0 makes the base call):
    ``name`` the argument or option field changed, ``argument`` the op's argument that holds it.
    ``wrong_type_objects``: only the scenarios that replace an option object by one of the wrong type."""
    sig = inspect.signature(op)
    covered = set()
    for i, base in enumerate(_bases(op, d)):
        for p in sig.parameters.values():
            if p.name == "rows" and not wrong_type_objects:
                covered.add(p.name)
                for what, kw in _rows_cases(op, base):
                    yield f"base {i}: {what}", "bad", p.name, p.name, kw
                continue
            if p.kind == p.VAR_KEYWORD:  # **fields: an unknown keyword
                covered.add(p.name)
                yield (f"base {i}: **{p.name} with an unknown keyword", "bad", p.name, p.name,
                       dict(base, not_an_argument=1))
                continue
            if p.name not in base and p.default is inspect.Parameter.empty:
                raise AssertionError(f"{op.__name__}'s required argument {p.name} is not in base call {i}")
            value = base.get(p.name, p.default)
            covered.add(p.name)
            if wrong_type_objects:
                # Not the argument that names the group (layer, student_layer): a rank given no layer at all
                # has no group in which to share its refusal.
                if isinstance(value, OPTIONS) and p.name not in ("layer", "student_layer"):
                    yield f"base {i}: {p.name} = object", "bad", p.name, p.name, dict(base, **{p.name: object()})
                if p.name == "student_layer":  # the two heads' layouts disagree, on one rank
                    alone = value.replace(sequence_parallel=not value.sequence_parallel)
                    yield (f"base {i}: student_layer.sequence_parallel alone different", "bad", "sequence_parallel",
                           p.name, dict(base, student_layer=alone))
                continue
            if isinstance(value, OPTIONS):  # each field of the object, then the object of the wrong type
                for path, field in _fields(value):
                    name = ".".join((p.name,) + path)
                    if path[-1] in NOT_VARIED:
                        continue
                    other = _different(field)
                    if other is None and not isinstance(field, torch.dtype):
                        continue
                    if path == ("sequence_parallel",) and p.name in ("student_layer", "teacher_layer"):
                        if p.name == "teacher_layer":
                            continue  # the two heads' hidden states share one layout: changed together below
                        both = {k: base[k].replace(sequence_parallel=other) for k in ("student_layer", "teacher_layer")}
                        yield f"base {i}: both layers' sequence_parallel different", "different", path[-1], p.name, \
                            dict(base, **both)
                        continue
                    try:
                        changed = _replace(value, path, other)
                    except (ValueError, TypeError):
                        continue  # not a valid value of the field: refused where the object is built
                    yield f"base {i}: {name} different", "different", path[-1], p.name, dict(base, **{p.name: changed})
                continue
            if p.name not in NOT_VARIED:
                other = _different(value)
                if other is not None or (isinstance(value, torch.dtype)):
                    yield f"base {i}: {p.name} different", "different", p.name, p.name, dict(base, **{p.name: other})
            for bad in _bad(value):
                yield (f"base {i}: {p.name} = {type(bad).__name__} {bad!r:.40}", "bad", p.name, p.name,
                       dict(base, **{p.name: bad}))
    assert covered == set(sig.parameters), covered


def _digest(result) -> int:
    """A 63-bit digest of what a rank's call gave: its outputs' values, or its error's message with its own
    rank's mention taken out (the same on every rank when they raise the same error)."""
    if result[0] == "raised":
        data = re.sub(r"this is rank \d", "", result[2]).encode()
    else:
        data = repr(result[1]).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _check_op(rank, world, op, wrong_type_objects=False):
    d = _data(rank, world)
    bases = _bases(op, d)
    failures, count = [], 0
    for what, kind, name, _, changed in _scenarios(op, d, rank, wrong_type_objects):
        base = bases[int(what.split(":")[0].split()[1])]
        kw = changed if rank == 1 else base
        t0 = time.monotonic()
        mine = _run(op, kw)
        took = time.monotonic() - t0
        # One all_gather a scenario: each rank's (rank, raised, digest, names rank 1, milliseconds). It is also
        # the check that the group stays usable after the scenario: every rank's row arrives, in rank order.
        row = torch.tensor([rank, mine[0] == "raised", _digest(mine), mine[0] == "raised" and "rank 1" in mine[2],
                            int(took * 1000)], dtype=torch.int64)
        every = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(every, row)
        count += 1
        assert [int(r[0]) for r in every] == list(range(world)), f"the group is unusable after {what}"
        raised = [bool(r[1]) for r in every]
        digests = {int(r[2]) for r in every}
        slow = max(int(r[4]) for r in every) / 1000
        if slow > 10:
            failures.append(f"{what}: took {slow:.1f} s")
        if kind == "different" and name in PER_RANK:
            ok = not any(raised) and len(digests) == 1
        elif not all(raised):
            ok = False
        else:  # the same error on every rank, naming rank 1
            ok = len(digests) == 1 and bool(every[0][3])
        if not ok:  # every rank sees the same rows, so every rank gathers the details here, or none does
            results = [None] * world
            dist.all_gather_object(results, mine)
            if kind == "different" and name in PER_RANK:
                failures.append(f"{what} (per rank by contract): {[r[:2] for r in results]}")
            elif not all(raised):
                failures.append(f"{what}: raised on ranks {[r for r in range(world) if raised[r]]} only: "
                                f"{[r[2][:200] if r[0] == 'raised' else 'returned' for r in results]}")
            else:
                failures.append(f"{what}: not the same error naming rank 1: {[r[2][:200] for r in results]}")
    assert count >= (1 if wrong_type_objects else 20) and not failures, (
        f"{len(failures)} of {count} scenarios failed:\n" + "\n".join(failures))


def _check_ops(rank, world, ops):
    for op in ops:
        _check_op(rank, world, op)
    for op in ops:  # then each option object of the wrong type (and a divergence's layers disagreeing)
        _check_op(rank, world, op, wrong_type_objects=True)


ALL_OPS = (log_probs_and_entropy, linear_log_probs_and_entropy, policy_loss_from_logits, linear_policy_loss,
           divergence_from_logits, linear_divergence, linear_divergence_loss)


@pytest.mark.parametrize("world", WORLDS)
def test_every_argument_changed_on_one_rank_fails_fast_on_every_rank(world):
    """One spawn per world size, every op's scenarios inside (a hang fails at the 20 s collective timeout).
    The same spawn then replaces each option object by one of the wrong type on one rank, and gives a divergence
    whose head alone is sequence parallel there: building the option objects happens before the op's agreed
    call; a refusal there still reaches every rank (through the group the layer names)."""
    run_distributed(_check_ops, world, ALL_OPS, timeout_s=20, deadline_s=480)


def test_the_scenarios_cover_every_argument_of_every_op():
    """Without a group: every argument of every op is enumerated, and each bad value is refused alone too."""
    ops = (log_probs_and_entropy, linear_log_probs_and_entropy, policy_loss_from_logits, linear_policy_loss,
           divergence_from_logits, linear_divergence, linear_divergence_loss)
    for op in ops:
        d = _data(0)
        names = {argument for _, _, _, argument, _ in _scenarios(op, d, 0)}
        assert names == set(inspect.signature(op).parameters), op.__name__
