"""The one preparation (``chunked_entropy._call.prepare``): what enters the per-token preparation, and how often.

Issue 46 item 5: a temperature passed to a divergence enters ``_inputs`` once, checked once for both heads
(before, it was checked against the student's transform in ``_inputs``, then against the teacher's in the
divergence's own preparation). Counted with wrappers around our own ``_inputs`` functions (each still runs):
the calls into ``_inputs`` from outside it that carry the caller's temperature object, and the calls of its
one temperature check, ``prepare_temperature``, and of the transform check, once per head.
"""

from __future__ import annotations

import functools
import inspect
import sys

import pytest
import torch

from chunked_entropy import (
    Divergence,
    OutputLayer,
    divergence_from_logits,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
)

F64 = torch.float64


class _Entries:
    """Wraps every function defined in ``chunked_entropy._inputs``, wherever a module of the package holds it
    (``monkeypatch``, undone after the test): ``entries`` counts the calls from outside ``_inputs`` (not one
    ``_inputs`` function calling another) that carry ``obj`` (by identity, positional or keyword), ``calls``
    every call by function name."""

    def __init__(self, monkeypatch, obj):
        from chunked_entropy import _inputs

        self.obj, self.entries, self.calls, self.depth = obj, 0, {}, 0
        funcs = {name: f for name, f in vars(_inputs).items()
                 if inspect.isfunction(f) and f.__module__ == _inputs.__name__}
        wrapped = {id(f): self._wrap(name, f) for name, f in funcs.items()}
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "chunked_entropy" or mod_name.startswith("chunked_entropy.")):
                continue
            for attr, value in list(vars(mod).items()):
                if id(value) in wrapped and inspect.isfunction(value):
                    monkeypatch.setattr(mod, attr, wrapped[id(value)])

    def _wrap(self, name, f):
        @functools.wraps(f)
        def counted(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.depth == 0 and any(a is self.obj for a in (*args, *kw.values())):
                self.entries += 1
            self.depth += 1
            try:
                return f(*args, **kw)
            finally:
                self.depth -= 1
        return counted


def _heads(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, hs, ht, v = 10, 6, 5, 24
    return dict(hs=torch.randn(n, hs, generator=g, dtype=F64, requires_grad=True),
                ws=torch.randn(v, hs, generator=g, dtype=F64), ht=torch.randn(n, ht, generator=g, dtype=F64),
                wt=torch.randn(v, ht, generator=g, dtype=F64), labels=torch.randint(0, v, (n,), generator=g),
                t=torch.rand(n, generator=g, dtype=F64) + 0.5)


def _calls(d, t):
    """Each divergence op, called with the temperature ``t`` and both heads carrying a transform."""
    student = OutputLayer(d["ws"], softcap=30.0)
    teacher = OutputLayer(d["wt"], logit_scale=0.5)
    zs, zt = (d["hs"] @ d["ws"].t()), d["ht"] @ d["wt"].t()
    return {
        "linear_divergence": lambda: linear_divergence(d["hs"], student, d["ht"], teacher, labels=d["labels"],
                                                       temperature=t, divergence=Divergence("jsd", 0.3)),
        "linear_divergence_loss": lambda: linear_divergence_loss(d["hs"], student, d["ht"], teacher, temperature=t),
        "divergence_from_logits": lambda: divergence_from_logits(
            zs, zt, labels=d["labels"], temperature=t, student_layer=OutputLayer(softcap=30.0),
            teacher_layer=OutputLayer(logit_scale=0.5)),
    }


@pytest.mark.parametrize("op", ["linear_divergence", "linear_divergence_loss", "divergence_from_logits"])
@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_a_divergence_temperature_enters_the_per_token_preparation_once(monkeypatch, op, kind):
    d = _heads()
    t = d["t"] if kind == "tensor" else float("0.7")
    call = _calls(d, t)[op]
    want = call()  # without the wrappers
    spy = _Entries(monkeypatch, t)
    got = call()
    assert spy.entries == 1, (op, spy.entries, spy.calls)  # the temperature enters _inputs once
    assert spy.calls.get("prepare_temperature") == 1, spy.calls  # and is checked once, for both heads
    assert spy.calls.get("check_transform_scale") == 2, spy.calls  # each head's factors over it: once each
    for a, b in zip(got, want, strict=True):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_with_rows_kept_the_temperature_is_checked_once():
    """``rows="kept"`` takes a per-token temperature at the kept rows first (a new tensor, so counted by the
    check, not by identity): still one check for both heads."""
    d = _heads(1)
    student, teacher = OutputLayer(d["ws"]), OutputLayer(d["wt"])
    mask = torch.arange(10) % 3 != 0
    with pytest.MonkeyPatch.context() as mp:
        spy = _Entries(mp, d["t"])
        out = linear_divergence(d["hs"], student, d["ht"], teacher, labels=d["labels"], label_mask=mask,
                                temperature=d["t"], rows="kept")
    assert spy.calls.get("prepare_temperature") == 1 and spy.calls.get("check_transform_scale") == 2, spy.calls
    assert out.divergence.shape == (10,)


def test_the_spy_sees_a_one_head_call_once_too():
    """The counter against an op whose temperature enters once by construction (one head, one transform)."""
    d = _heads(2)
    with pytest.MonkeyPatch.context() as mp:
        spy = _Entries(mp, d["t"])
        linear_log_probs_and_entropy(d["hs"], OutputLayer(d["ws"], softcap=30.0), d["labels"], temperature=d["t"])
    assert spy.entries == 1 and spy.calls["prepare_temperature"] == 1 and spy.calls["check_transform_scale"] == 1


def test_a_field_agreed_twice_in_one_call_is_a_bug_not_a_silent_overwrite():
    """The op's preparation and a ``rows=`` selection record into one agreed call; a second value under a name
    would replace the first, which then no rank compares (the selection's ``layer.sequence_parallel`` was lost
    so once). Recorded as a group of two would record it (no collective is made here)."""
    from chunked_entropy.parallel import CallCheck

    call = CallCheck(None, 0, 2)
    call.agree("layer.sequence_parallel", 1)
    with pytest.raises(RuntimeError, match="'layer.sequence_parallel' is agreed twice in one call"):
        call.agree("layer.sequence_parallel", 0)
    assert call.fields == {"layer.sequence_parallel": 1}
