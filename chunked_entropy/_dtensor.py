"""DTensor inputs: vocabulary-sharded logits and column-parallel weights, read as their local shards.

Layer: front (wraps the public ops, as :mod:`chunked_entropy._migrate` does;
nothing below it knows DTensors). A ``torch.distributed.tensor.DTensor``
argument is taken apart here, once per call, into what the ops already
serve: the local shard, and the process group of the mesh dimension that
shards the vocabulary (``device_mesh.get_group(dim)``: a 1-D TP mesh, or the
TP dimension of a larger mesh). The op runs on plain tensors; its outputs
are put back together as DTensors on the same mesh.

Placements (what torchtitan's ``partial_dtensor`` backend and
``torch.distributed.tensor.parallel`` use):

- logits: ``Shard(-1)`` on one mesh dimension (the vocabulary, split evenly:
  every rank the same ``V / tp`` columns, as the ops require), ``Replicate()``
  on the others, or ``Shard(d)`` of a leading (token) dimension there: each
  rank then serves its own rows;
- a fused head's weight ``[V, H]``: ``Shard(0)`` on one mesh dimension (a
  column-parallel output layer: torchtitan's ``lm_head``, ``ColwiseParallel``),
  ``Replicate()`` on the others; its bias ``Shard(0)`` alike;
- hidden states: ``Replicate()`` on the vocabulary's mesh dimension (a
  ``Shard`` there, sequence parallelism, is gathered first through DTensor's
  own differentiable redistribution), the others as for logits.

Per-token outputs are DTensors placed ``Replicate()`` on the vocabulary's
mesh dimension (every rank holds the same values, as
``loss_parallel``'s cross entropy does) and as the input on the others; a
scalar loss is ``Replicate()`` everywhere. The logits' gradient arrives as a
DTensor with the logits' own placements (``Shard(-1)``), a weight's as the
weight's (``Shard(0)``), except ``Partial()`` on a mesh dim where the weight
is replicated and the hidden states' rows are sharded (each rank's part of
the gradient, as torch's own matmul gives it). Another DTensor argument (labels, a mask, a
temperature) must sit on the same mesh with the outputs' placements; plain
tensors are taken as this rank's rows. ``.to_local()`` of an output is the
plain tensor, identical on every rank of the vocabulary's group.

Memory: nothing is copied. ``to_local()`` and ``DTensor.from_local()`` are
views with autograd; the gather of sequence-parallel hidden states is
DTensor's all-gather (``[S, H]`` per rank, as the layer's own forward makes).

Refused, before any work and on every rank alike (a DTensor's placements are
the same on every rank): a ``Partial`` placement, the vocabulary sharded on
two mesh dimensions or unevenly, a weight sharded on a second mesh dimension
(an FSDP2 shard: run inside the module's forward, where FSDP2 unshards it),
a ``layer.process_group`` other than the mesh's, arguments on two meshes.
What one rank alone may refuse (its ``rows=``, its ``layer``, another
argument's placements) goes through the ranks' agreement
(:func:`~chunked_entropy.parallel.refused_together`): every rank of the
vocabulary's group raises it, none is left in the op's next collective, and
the checks all come before the gather of sequence-parallel hidden states.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .options import OutputLayer, as_layer
from .parallel import refused_together

__all__ = ["VocabShard", "dtensor_hidden_op", "dtensor_logits_op", "is_dtensor", "vocab_shard"]


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (without importing ``torch.distributed.tensor`` when nothing did)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def _shard_dim(p, ndim: int) -> Optional[int]:
    """The tensor dim ``p`` shards (normalized), or None for a replica; a ValueError for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Replicate):
        return None
    if type(p) is Shard:
        return p.dim % ndim if ndim else p.dim
    return -1  # Partial, a strided shard, ...: the caller names it


@dataclass(frozen=True)
class VocabShard:
    """How a DTensor splits the vocabulary: its mesh, the mesh dim that shards the vocabulary (None: a replica),
    that dim's process group, and the placements of the per-token outputs."""

    mesh: object
    dim: Optional[int]
    group: object
    out_placements: tuple
    rows_sharded: bool  # a leading (token) dim sharded on another mesh dim

    def local(self, name: str, t):
        """Another argument on this rank: a plain tensor as it is; a DTensor on the same mesh, placed as the
        outputs, as its local tensor."""
        if not is_dtensor(t):
            return t
        if t.device_mesh != self.mesh:
            raise ValueError(f"{name} is a DTensor on another device mesh than the logits' ({t.device_mesh} vs "
                             f"{self.mesh}): pass it on the same mesh, or as a plain tensor of this rank's rows")
        expected = self.out_placements[:len(t.placements)]
        if tuple(t.placements) != tuple(expected):
            raise ValueError(f"{name} is a DTensor placed {tuple(t.placements)}; expected {tuple(expected)} "
                             "(replicated over the vocabulary's mesh dim, its rows split as the logits' are), or "
                             "a plain tensor of this rank's rows")
        return t.to_local()

    def wrap(self, t, lead_global: tuple):
        """A local output as a DTensor on the mesh: replicated over the vocabulary's dim, rows as the input's."""
        if not isinstance(t, torch.Tensor) or is_dtensor(t):
            return t
        from torch.distributed.tensor import DTensor, Replicate

        if t.dim() == 0:
            return DTensor.from_local(t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        # the global shape: a token dim sharded over a mesh dim has the input's global size; every other dim is
        # the local one (with ``rows=`` the outputs are per selected row: refused with sharded rows)
        shape = list(t.shape)
        for p in self.out_placements:
            d = _shard_dim(p, len(lead_global) + 1)
            if d is not None and d < t.dim():
                shape[d] = lead_global[d]
        shape = tuple(shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(t, self.mesh, self.out_placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride)


def vocab_shard(t, name: str = "logits", *, vocab_dim: int = -1, kind: str = "logits") -> VocabShard:
    """Read a DTensor's placements: which mesh dim shards ``vocab_dim`` (``-1``: logits; ``0``: a weight).

    A ValueError naming ``name`` and what was expected for a placement the ops cannot serve in place.
    """
    mesh, placements, ndim = t.device_mesh, tuple(t.placements), t.dim()
    vdim = vocab_dim % ndim
    vocab, rows = [], False
    for i, p in enumerate(placements):
        d = _shard_dim(p, ndim)
        if d == -1:
            raise ValueError(f"{name} is a DTensor placed {placements}: {p} on mesh dim {i} cannot be read in place; "
                             f"expected Shard({vocab_dim}) on the tensor-parallel mesh dim and Replicate() (or a "
                             f"Shard of a token dim) on the others: redistribute it first")
        if d == vdim:
            vocab.append(i)
        elif d is not None:
            if kind == "weight":
                raise ValueError(f"{name} is a DTensor placed {placements}: sharded on dim {d} over mesh dim {i} "
                                 "too (an FSDP2 shard?); a column-parallel weight is Shard(0) on the tensor-parallel "
                                 "mesh dim and Replicate() on the others: call the op inside the module's forward, "
                                 "where FSDP2 has unsharded it, or pass weight.full_tensor() along the others")
            rows = True
    if len(vocab) > 1:
        raise ValueError(f"{name} is a DTensor placed {placements}: its vocabulary is sharded over mesh dims {vocab}; "
                         "expected one (the tensor-parallel dim)")
    dim = vocab[0] if vocab else None
    if dim is not None and t.shape[vdim] % mesh.size(dim):
        raise ValueError(f"{name} is a DTensor whose vocabulary of {t.shape[vdim]} is split unevenly over "
                         f"{mesh.size(dim)} ranks (mesh dim {dim}); the ops need every rank to hold V / tp "
                         f"columns: pad the vocabulary to a multiple of {mesh.size(dim)}")
    from torch.distributed.tensor import Replicate

    out = tuple(Replicate() if i == dim else p for i, p in enumerate(placements))
    group = mesh.get_group(dim) if dim is not None else None
    return VocabShard(mesh, dim, group, out, rows)


def _with_group(layer, name: str, group, *, logits: bool):
    """``layer`` (an OutputLayer, None, or a bare weight) with the mesh's group; a ValueError for another group."""
    value = as_layer(layer, name, logits=logits)
    own = value.process_group
    if own is not None and own is not group:
        raise ValueError(f"{name}.process_group must be None or the DTensor's mesh group for the vocabulary's "
                         "mesh dim (device_mesh.get_group(dim)): the group comes from the mesh")
    return value if own is group else value.replace(process_group=group)


def _wrap_result(res, shard: VocabShard, lead: tuple, *, scalar_ok: bool):
    from ._outputs import LogProbsEntropy

    w = functools.partial(shard.wrap, lead_global=lead)
    if isinstance(res, LogProbsEntropy):
        return LogProbsEntropy(w(res.log_probs), w(res.entropy), w(res.sum_pi_squared), w(res.log_probs_at),
                               w(res.top_k_ids), w(res.top_k_log_probs))
    if isinstance(res, tuple) and hasattr(res, "_fields"):  # DivergenceOutputs (its attributes too), DivergenceLoss
        return type(res)(*(w(x) for x in (*res, *(getattr(res, f) for f in getattr(res, "_extra", ())))))
    if isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.Tensor):  # (loss, metrics)
        return (w(res[0]), res[1])
    return res


def _check_rows(shard: VocabShard, name: str, rows) -> None:
    if shard.rows_sharded and rows is not None:
        raise ValueError(f"rows= with {name} a DTensor whose rows are sharded over another mesh dim: the selected "
                         "rows of each rank are its own; pass the local tensors (.to_local()) and the vocabulary's "
                         "group instead")


def _check_scalar(shard: VocabShard, name: str, op: str) -> None:
    if shard.rows_sharded:
        raise ValueError(f"{name} is a DTensor whose rows are sharded over another mesh dim; {op} returns one "
                         "scalar over the rows: pass the local rows (.to_local()) with "
                         "layer=OutputLayer(process_group=device_mesh.get_group(tp_dim)) and aggregate over "
                         "the other dim yourself")


def dtensor_logits_op(*, logits=("logits",), layers=("layer",), scalar: bool = False):
    """Decorate a logits op: a DTensor in ``logits[0]`` is served on its local shard with the mesh's group.

    ``logits[1:]`` (a teacher's logits) must then be DTensors placed alike, or plain local shards; every
    ``layers`` argument gets the group; any other DTensor argument is taken as its local tensor
    (:meth:`VocabShard.local`). ``scalar``: the op returns a scalar over the rows (refused for row shards).
    """

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args, **kwargs):
            if not any(is_dtensor(a) for a in args) and not any(is_dtensor(v) for v in kwargs.values()):
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            a = bound.arguments
            main = a.get(logits[0])
            if not is_dtensor(main):
                named = next(k for k, v in a.items() if is_dtensor(v))
                raise ValueError(f"{named} is a DTensor but {logits[0]} is not: pass {logits[0]} as the "
                                 "vocabulary-sharded DTensor too, or every argument as plain local tensors")
            shard = vocab_shard(main, logits[0])  # placements: the same on every rank, refused alike
            # what may differ between the ranks (rows=, the layer, the other arguments) is refused through the
            # ranks' agreement, met by the peers' first agreed call in the op (nothing here is a collective)
            with refused_together(shard.group):
                if scalar:
                    _check_scalar(shard, logits[0], fn.__name__)
                _check_rows(shard, logits[0], a.get("rows"))
                lead = tuple(main.shape[:-1])
                a[logits[0]] = main.to_local()
                for name in logits[1:]:
                    other = a.get(name)
                    if is_dtensor(other):
                        if other.device_mesh != shard.mesh or tuple(other.placements) != tuple(main.placements):
                            raise ValueError(f"{name} is a DTensor placed {tuple(other.placements)} on "
                                             f"{other.device_mesh}; expected {logits[0]}'s placements "
                                             f"{tuple(main.placements)} on the same mesh")
                        a[name] = other.to_local()
                for name in layers:
                    a[name] = _with_group(a.get(name), name, shard.group, logits=True)
                for name, v in list(a.items()):
                    if is_dtensor(v):
                        a[name] = shard.local(name, v)
            return _wrap_result(fn(*bound.args, **bound.kwargs), shard, lead, scalar_ok=scalar)

        op.__signature__ = sig
        return op

    return deco


def _local_layer(layer, name: str):
    """An op's layer whose weight is a DTensor (column-parallel), checked: ``(layer, shard)``, shard None for a
    plain weight. The weight and bias stay DTensors here: :func:`_to_local_layer` reads them once the hidden
    states' placements say how their gradients are placed."""
    value = as_layer(layer, name)
    w = value.weight
    if not is_dtensor(w):
        if is_dtensor(value.bias):
            raise ValueError(f"{name}.bias is a DTensor but {name}.weight is not: pass both as DTensors or both "
                             "as local shards")
        return value, None
    shard = vocab_shard(w, f"{name}.weight", vocab_dim=0, kind="weight")
    b = value.bias
    if is_dtensor(b):
        if b.device_mesh != w.device_mesh or tuple(b.placements) != tuple(w.placements):
            raise ValueError(f"{name}.bias is a DTensor placed {tuple(b.placements)}; expected the weight's "
                             f"{tuple(w.placements)} on the same mesh")
    own = value.process_group
    if own is not None and own is not shard.group:
        raise ValueError(f"{name}.process_group must be None or the weight's mesh group for the vocabulary's mesh "
                         "dim (device_mesh.get_group(dim)): the group comes from the mesh")
    return value, shard


def _to_local_layer(value, shard: Optional[VocabShard], rows_placements: Optional[tuple]):
    """The checked layer on its local shards with the mesh's group. ``rows_placements``: the hidden states'
    placements (None: plain hidden states). On a mesh dim where the weight is replicated and the rows are
    sharded, each rank's weight (and bias) gradient is the part of its own rows: placed ``Partial()`` there, as
    torch's own matmul places it, so that ``.grad`` sums the ranks' parts instead of calling one rank's part
    the whole."""
    if shard is None:
        return value
    from torch.distributed.tensor import Partial, Replicate

    w, b = value.weight, value.bias
    grad = tuple(w.placements)
    if rows_placements is not None:
        grad = tuple(Partial() if isinstance(wp, Replicate) and not isinstance(hp, Replicate) else wp
                     for wp, hp in zip(grad, rows_placements, strict=True))
    b = b.to_local(grad_placements=grad) if is_dtensor(b) else b
    return value.replace(weight=w.to_local(grad_placements=grad), bias=b, process_group=shard.group)


def _local_hidden(h, name: str, shard: Optional[VocabShard]):
    """Hidden states on this rank, checked: ``(h, out_shard)``, out_shard None for a plain tensor (returned as
    it is); a DTensor is returned as it is too, ``out_shard`` placed as it will be once :func:`_gather_hidden`
    has gathered it over the vocabulary's mesh dim. No collective."""
    if not is_dtensor(h):
        return h, None
    from torch.distributed.tensor import Replicate

    if shard is None:
        raise ValueError(f"{name} is a DTensor but the layer's weight is not: pass the weight as the "
                         "column-parallel DTensor (Shard(0) on the tensor-parallel mesh dim) too")
    if h.device_mesh != shard.mesh:
        raise ValueError(f"{name} is a DTensor on another device mesh than the weight's ({h.device_mesh} vs "
                         f"{shard.mesh})")
    placements = tuple(h.placements)
    for i, p in enumerate(placements):
        d = _shard_dim(p, h.dim())
        if d == -1 or (d is not None and d == h.dim() - 1):
            raise ValueError(f"{name} is a DTensor placed {placements}: {p} on mesh dim {i} cannot be served; "
                             "expected Replicate() on the tensor-parallel mesh dim (or a Shard of a token dim, "
                             "gathered here) and Replicate() or a token-dim Shard on the others")
    gathered = tuple(Replicate() if i == shard.dim else p for i, p in enumerate(placements))
    out = VocabShard(shard.mesh, shard.dim, shard.group, gathered, any(not isinstance(p, Replicate) for p in gathered))
    return h, out


def _gather_hidden(h, out: VocabShard):
    """DTensor hidden states placed ``out.out_placements``: a ``Shard`` over the vocabulary's mesh dim (sequence
    parallelism) gathered through DTensor's differentiable redistribution (a collective)."""
    if tuple(h.placements) != tuple(out.out_placements):
        h = h.redistribute(h.device_mesh, list(out.out_placements))
    return h


def _weight_of(layer):
    """The weight an op's ``layer`` argument holds (an OutputLayer's, or a bare tensor), else None; unchecked."""
    return layer.weight if isinstance(layer, OutputLayer) else layer


def _has_dtensor(v) -> bool:
    if isinstance(v, OutputLayer):
        return is_dtensor(v.weight) or is_dtensor(v.bias)
    return is_dtensor(v)


def dtensor_hidden_op(*, pairs=(("hidden", "layer"),), scalar: bool = False):
    """Decorate an op over hidden states: a layer whose weight is a column-parallel DTensor is served on its
    local shard with the mesh's group; DTensor hidden states give DTensor outputs (plain ones, plain outputs).

    ``pairs``: ``(hidden, layer)`` argument names (a student's and a teacher's); the layers must share a mesh.
    """

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args, **kwargs):
            if not any(_has_dtensor(v) for v in (*args, *kwargs.values())):
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            a = bound.arguments
            # the weights' placements first (the same on every rank, refused alike): they give the group
            weight = next(((ln, w) for _, ln in pairs for w in [_weight_of(a.get(ln))] if is_dtensor(w)), None)
            group = None
            if weight is not None:
                group = vocab_shard(weight[1], f"{weight[0]}.weight", vocab_dim=0, kind="weight").group
            # what may differ between the ranks (rows=, a layer, the other arguments) is refused through the
            # ranks' agreement, met by the peers' first agreed call in the op: every check before any collective
            out_shard, lead, weight_shard, checked = None, None, None, []
            with refused_together(group):
                for hidden_name, layer_name in pairs:
                    layer, shard = _local_layer(a.get(layer_name), layer_name)
                    if shard is not None:
                        if weight_shard is not None and (shard.mesh != weight_shard.mesh
                                                         or shard.dim != weight_shard.dim):
                            raise ValueError(f"{layer_name}.weight is on another mesh (or mesh dim) than "
                                             f"{pairs[0][1]}.weight: the two layers must share the vocabulary's "
                                             "group")
                        weight_shard = weight_shard or shard
                    h, hs = _local_hidden(a.get(hidden_name), hidden_name, shard)
                    if hs is not None:
                        if scalar:
                            _check_scalar(hs, hidden_name, fn.__name__)
                        _check_rows(hs, hidden_name, a.get("rows"))
                        if out_shard is None:
                            out_shard, lead = hs, tuple(h.shape[:-1])
                    checked.append((hidden_name, layer_name, layer, shard, h, hs))
                if out_shard is None:
                    for name, v in list(a.items()):
                        if is_dtensor(v):
                            raise ValueError(f"{name} is a DTensor but the hidden states are not: pass plain "
                                             "tensors with plain hidden states")
                else:
                    for name, v in list(a.items()):
                        if is_dtensor(v) and name not in {n for pair in pairs for n in pair}:
                            a[name] = out_shard.local(name, v)
            for hidden_name, layer_name, layer, shard, h, hs in checked:
                a[layer_name] = _to_local_layer(layer, shard, None if hs is None else hs.out_placements)
                a[hidden_name] = h if hs is None else _gather_hidden(h, hs).to_local()
            if out_shard is None:
                return fn(*bound.args, **bound.kwargs)
            return _wrap_result(fn(*bound.args, **bound.kwargs), out_shard, lead, scalar_ok=scalar)

        op.__signature__ = sig
        return op

    return deco
