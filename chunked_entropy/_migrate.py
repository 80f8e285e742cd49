"""0.1's flat keywords, mapped onto 0.2's option objects (kept through 0.2.x, removed in 0.3.0).

Layer: migration (wraps the ops; nothing below it knows the old names).
:func:`accepts_01_keywords` decorates each public op and the head: an old
keyword (``chunk_size=``, ``softcap=``, ``student_bias=``, ``loss_mode=``,
a policy option by its verl name, ...) is moved to its field in the
:class:`~chunked_entropy.OutputLayer`, :class:`~chunked_entropy.Chunking`,
:class:`~chunked_entropy.PolicyLoss` or :class:`~chunked_entropy.Divergence`
the op now takes, and a ``DeprecationWarning`` names the new form. The call
then runs as the new one would: the same checks, the same result.
``inspect.signature`` of a decorated op shows its new signature.

An old keyword cannot be mixed with the argument it moved into (``chunking=Chunking(...)`` or ``chunking=8``
and ``chunk_size=``; a bare weight as the layer and ``weight=``): that call is a TypeError naming both, as
Python names a keyword given twice. Where 0.1 took a bare value in the same place (the weight positionally,
``divergence="jsd"``), its other keywords beside it are that 0.1 call (``softcap=``, ``beta=``).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Optional

import torch

from .losses.aggregation import Aggregation
from .losses.policy_options import PolicyOptions
from .options import Chunking, Divergence, OutputLayer, PolicyLoss, errors_named
from .parallel import refused_together

__all__ = ["accepts_01_keywords"]

#: The release that removes the old keywords.
REMOVED_IN = "0.3.0"

_LAYER = ("bias", "softcap", "logit_scale", "logits_dtype", "process_group", "sequence_parallel",
          "gradient_accumulation_fusion")
_LOGITS_LAYER = ("process_group", "softcap", "logit_scale")
_CHUNKING = ("chunk_size", "vocab_chunk_size", "backend")
_LOSS = {"loss_mode": "mode", "entropy_coeff": "entropy_coeff", "kl_coef": "kl_coef", "kl_kind": "kl_kind",
         "entropy_of": "entropy_of", "options": "options"}
_AGGREGATION = {"loss_agg_mode": "mode", "loss_scale_factor": "loss_scale_factor", "dp_size": "dp_size",
                "batch_num_tokens": "batch_num_tokens", "global_batch_size": "global_batch_size"}


def _table(layer=(), chunking=_CHUNKING, *, two_heads=False, loss=False, weight=None, divergence=False) -> dict:
    """old keyword -> [(new argument, field), ...]."""
    t = {k: [("chunking", k)] for k in chunking}
    if two_heads:
        for side in ("student", "teacher"):
            for k in ("bias", "softcap", "logit_scale"):
                t[f"{side}_{k}"] = [(f"{side}_layer", k)]
            t[f"{side}_weight"] = [(f"{side}_layer", "weight")]
        for k in layer:
            t[k] = [("student_layer", k), ("teacher_layer", k)]
    else:
        t.update({k: [("layer", k)] for k in layer})
    if weight:
        t["weight"] = [("layer", "weight")]
    if loss:
        t.update({k: [("loss", f)] for k, f in _LOSS.items()})
        t.update({k: [("loss.aggregation", f)] for k, f in _AGGREGATION.items()})
    if divergence:
        t["beta"] = [("divergence", "beta")]
    return t


#: Each op's old keywords; see :func:`accepts_01_keywords`.
TABLES = {
    "log_probs_and_entropy": _table(_LOGITS_LAYER, ("chunk_size", "backend")),
    "linear_log_probs_and_entropy": _table(_LAYER, weight=True),
    "linear_policy_loss": _table(_LAYER, weight=True, loss=True),
    "policy_loss_from_logits": _table(_LOGITS_LAYER, ("chunk_size", "backend"), loss=True),
    "linear_divergence": _table(("process_group", "sequence_parallel", "logits_dtype"), ("chunk_size",
                                "vocab_chunk_size"), two_heads=True, divergence=True),
    "linear_divergence_loss": _table(("process_group", "sequence_parallel", "logits_dtype"), ("chunk_size",
                                     "vocab_chunk_size"), two_heads=True, divergence=True),
    "divergence_from_logits": _table(("process_group",), ("chunk_size",), two_heads=True, divergence=True),
    "ChunkedVocabParallelHead": _table(_LAYER, weight=True),
    "DivergenceLoss": _table(("process_group", "sequence_parallel", "logits_dtype"), ("chunk_size",
                             "vocab_chunk_size"), two_heads=True, divergence=True),
}

_BARE = {"layer": torch.Tensor, "student_layer": torch.Tensor, "teacher_layer": torch.Tensor,
         "chunking": (int, str), "divergence": str}

#: Where 0.1 took a bare value in the new argument's place (the weight positionally, the divergence's name
#: by keyword), the field it sets: beside it 0.1's keywords for the other fields are that 0.1 call. Every other
#: new argument given (``chunking``: 0.1 had none) beside an old keyword moving into it is a TypeError.
_BARE_FIELD = {"layer": "weight", "student_layer": "weight", "teacher_layer": "weight", "divergence": "kind"}


def _build(arg: str, current, changes: dict, op: str, chunking: Optional[Chunking] = None):
    """The new argument ``arg`` from its ``current`` value (default, or a bare tensor / int / name) and the old
    keywords' ``changes`` (``chunking``: the op's default :class:`~chunked_entropy.Chunking`, which old keywords
    change field by field, as 0.1's defaults were the op's own)."""
    if arg in ("layer", "student_layer", "teacher_layer"):
        if isinstance(current, torch.Tensor):
            changes = {"weight": current, **changes}
        with errors_named(arg):  # errors name the op's argument: teacher_layer.softcap
            return OutputLayer(**changes)
    if arg == "chunking":
        if current is None and chunking is not None:
            return chunking.replace(**changes)
        if current is not None and not isinstance(current, Chunking):
            changes = {"chunk_size": current, **changes}
        return Chunking(**changes)
    if arg == "divergence":
        return Divergence(**({"kind": current} if isinstance(current, str) else {}), **changes)
    if arg == "loss":
        fields = dict(changes.get("loss", {}))
        options = fields.pop("options", None)
        if changes.get("loss.options"):
            options = (options or PolicyOptions()).replace(**changes["loss.options"])
        if options is not None:
            fields["options"] = options
        agg = changes.get("loss.aggregation")
        if agg:
            fields["aggregation"] = Aggregation(**agg)
        return PolicyLoss(**fields)
    raise AssertionError(f"{op}: no rule for {arg}")  # pragma: no cover - the tables above name only these


def _describe(arg: str, changes: dict) -> str:
    if arg == "loss":
        parts = [f"{f}=..." for f in changes.get("loss", {})]
        if changes.get("loss.options"):
            parts.append("options=PolicyOptions(" + ", ".join(f"{f}=..." for f in changes["loss.options"]) + ")")
        if changes.get("loss.aggregation"):
            parts.append("aggregation=Aggregation(" + ", ".join(f"{f}=..." for f in changes["loss.aggregation"])
                         + ")")
        return f"loss=PolicyLoss({', '.join(parts)})"
    cls = {"chunking": "Chunking", "divergence": "Divergence"}.get(arg, "OutputLayer")
    return f"{arg}={cls}({', '.join(f'{f}=...' for f in changes)})"


def _group_in(args: tuple, kw: dict):
    """The group of a call (0.1's ``process_group=``, or a layer's), for sharing a refusal with its ranks."""
    if kw.get("process_group") is not None:
        return kw["process_group"]
    layers = (v for v in (*args, *kw.values()) if isinstance(v, OutputLayer) and v.process_group is not None)
    return next((v.process_group for v in layers), None)


def _targets(table: dict, key: str) -> set:
    return {arg.split(".")[0] for arg, _ in table.get(key, [("loss", None)])}


def accepts_01_keywords(op: str, *, policy_fields: bool = False, old_bias_position=None,
                        chunking: Optional[Chunking] = None):
    """Decorate ``op`` (a public function, or a class's ``__init__``) so that 0.1's keywords keep working.

    ``policy_fields``: an unknown keyword is a field of :class:`~chunked_entropy.losses.PolicyOptions` (0.1's
    ``**fields`` of the fused losses). ``old_bias_position``: the positional index where 0.1 took the bias
    (the head's ``ChunkedVocabParallelHead(weight, bias)``); a tensor there is taken as ``bias=``.
    ``chunking``: the op's default where it is not :class:`~chunked_entropy.Chunking`'s (the divergences' 256
    rows): ``vocab_chunk_size=`` alone keeps that chunk size, as in 0.1.
    """
    table = TABLES[op]

    def wrap(fn):
        sig = inspect.signature(fn)
        params = sig.parameters

        @functools.wraps(fn)
        def call(*args, **kw):
            # A refusal here (an unknown keyword, both forms given, a bad old value) is shared with the ranks of
            # the call's group, which meet it in their op's agreed call: none waits for this rank.
            with refused_together(_group_in(args, kw)):
                args, kw = _migrated(args, kw)
            return fn(*args, **kw)

        def _migrated(args, kw):
            """The call's ``(args, kwargs)`` in 0.2's form (bound to the signature: Python's own TypeError for
            an unknown or missing argument is raised here, inside the sharing)."""
            old = {k: kw.pop(k) for k in list(kw) if k in table and k not in params}
            if old_bias_position is not None and len(args) > old_bias_position and (
                    isinstance(args[old_bias_position], torch.Tensor)):
                old["bias"] = args[old_bias_position]
                args = args[:old_bias_position] + args[old_bias_position + 1:]
            fields = {}
            if policy_fields:
                fields = {k: kw.pop(k) for k in list(kw) if k not in params}
                unknown = sorted(set(fields) - set(PolicyOptions.__dataclass_fields__))
                if unknown:
                    raise TypeError(f"{op}() got an unexpected keyword argument {unknown[0]!r}")
            if not old and not fields:
                sig.bind(*args, **kw)
                return args, kw
            bound = sig.bind_partial(*args, **kw)
            changes = {}  # new argument -> {field: value}; the loss: its parts
            for k, value in old.items():
                for arg, f in table[k]:
                    top = arg.split(".")[0]
                    part = changes.setdefault(top, {})
                    (part.setdefault(arg, {}) if top == "loss" else part)[f] = value
            if fields:
                changes.setdefault("loss", {}).setdefault("loss.options", {}).update(fields)
            for arg, part in changes.items():
                current = bound.arguments.get(arg, params[arg].default)
                if current is not None and arg in bound.arguments:
                    named = sorted(k for k in {**old, **fields} if arg in _targets(table, k))
                    if arg in _BARE_FIELD and isinstance(current, _BARE[arg]):  # 0.1's own value there
                        named = [k for k in named if (arg, _BARE_FIELD[arg]) in table.get(k, ())]
                    if named:
                        raise TypeError(
                            f"{op}() got both {arg}= and 0.1's keyword(s) {named} that it replaces: pass the "
                            f"settings in {arg} only")
                if current is inspect.Parameter.empty:
                    current = None
                bound.arguments[arg] = _build(arg, current, part, op, chunking)
            warnings.warn(
                f"{op}: the keyword(s) {', '.join(sorted({**old, **fields}))} are 0.1's and go in {REMOVED_IN}; "
                f"pass {'; '.join(_describe(a, p) for a, p in changes.items())} (see CHANGELOG.md)",
                DeprecationWarning, stacklevel=3,
            )
            sig.bind(*bound.args, **bound.kwargs)
            return bound.args, bound.kwargs

        return call

    return wrap
