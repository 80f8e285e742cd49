"""megatron-core: a ``GPTModel`` or ``MambaModel`` that returns log-probs and entropy from hidden states.

:func:`enable_fused_log_probs` makes ``model(input_ids, position_ids,
attention_mask, labels=labels)`` return a
:class:`~chunked_entropy.LogProbsEntropy` shaped like ``labels`` ``[B, S]``
instead of the cross-entropy loss: the decoder's hidden states go through a
:class:`~chunked_entropy.ChunkedVocabParallelHead` built on the model's own
output layer (or the tied embedding weight), so the ``[S, B, V/TP]`` logits
never exist. :func:`disable_fused_log_probs` restores the model.

How it hooks in:

- megatron-core >= 0.18 (``GPTModel.forward`` takes ``output_processor`` and
  ``output_processor_context``): the instance's ``forward`` passes our
  processor whenever ``labels`` are given and the caller passed none.
- older megatron-core (0.16, 0.17): the instance's ``_postprocess`` is
  replaced; it falls back to the original whenever ``labels`` is None, in
  inference, or on a stage without the output layer.
- ``MambaModel`` (megatron-core 0.16 - 0.18; its post-processing is inline
  in ``forward``, with no hook): for the duration of a call with labels, the
  instance's output layer hands on the hidden states and its
  ``compute_language_model_loss`` runs the fused head (it takes no
  ``loss_mask``: pass ``label_mask``). megatron-core 0.19's ``HybridModel``
  has the same inline code, but is not tested here (it needs Python >= 3.12).

Only the instance is changed, never the class. Without ``labels`` the model
returns its logits as before.

Per-call options (temperature, whether the entropy is computed, a label mask):

- ``with fused_log_probs_options(model, temperature=..., compute_entropy=..., label_mask=...):``
  around the forward call (any megatron-core version);
- with megatron-core >= 0.18, also ``model(..., output_processor_context=FusedLogProbsOptions(...))``;
- the forward's own ``loss_mask=`` ([B, S], bool or 0/1) masks the log-probs
  when no ``label_mask`` option is set.

Defaults come from ``enable_fused_log_probs(model, config, temperature=..., ...)``.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from einops import rearrange

from .._checks import is_finite_real, value_repr
from .._outputs import LogProbsEntropy
from ..config import ChunkedEntropyConfig
from ..head import ChunkedVocabParallelHead
from ..options import Chunking, OutputLayer
from ..parallel import agreed_call, default_tp_group
from ._common import refuse_fp8_output_layer

__all__ = [
    "FusedLogProbsOptions",
    "disable_fused_log_probs",
    "enable_fused_log_probs",
    "fused_log_probs_options",
]

_STATE = "_chunked_entropy_fused"
_MISSING = object()
#: ``enable_fused_log_probs``'s keywords: the head's :class:`~chunked_entropy.Chunking` fields, its
#: :class:`~chunked_entropy.OutputLayer` fields (overriding the output layer's), the per-call defaults.
_CHUNKING_KEYS = ("chunk_size", "vocab_chunk_size")
_LAYER_KEYS = ("process_group", "sequence_parallel", "gradient_accumulation_fusion")
_CALL_KEYS = ("temperature", "compute_entropy")


@dataclass(frozen=True, eq=False)  # identity, not tensor-valued equality
class FusedLogProbsOptions:
    """Per-call options; a field left None takes the default given to :func:`enable_fused_log_probs`.

    Attributes:
        temperature: a float > 0, or a tensor: per sample ``[B]`` or ``[B, 1]``,
            or per token ``[B, S]`` (Megatron's labels layout).
        compute_entropy: False returns ``entropy=None`` and skips its work.
        label_mask: bool ``[B, S]``: where False the log-prob is 0 and passes
            no gradient (the forward's ``loss_mask`` is used when this is None).
    """

    temperature: Union[None, float, torch.Tensor] = None
    compute_entropy: Optional[bool] = None
    label_mask: Optional[torch.Tensor] = None


@dataclass
class _State:
    head: ChunkedVocabParallelHead
    temperature: float
    compute_entropy: bool
    hook: bool  # megatron-core's output_processor hook (else the _postprocess override)
    saved: dict  # instance attributes replaced -> their previous value (or _MISSING)
    options: list = field(default_factory=list)  # stack of fused_log_probs_options


def _unwrap(model):
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module: ``.module``)."""
    inner = model
    while not hasattr(inner, "output_layer") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    return inner


def _forward_params(model) -> frozenset:
    """The parameter names of ``model``'s class's ``forward`` (none where its signature cannot be read)."""
    try:
        return frozenset(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _supports_hook(model) -> bool:
    return {"output_processor", "output_processor_context"} <= _forward_params(model)


def _check_temperature(value, name="temperature"):
    if not (is_finite_real(value) and value > 0):
        raise ValueError(f"{name} must be a finite float > 0, got {value_repr(value)}")
    return float(value)


def _settings(config, head_kwargs, v_local):
    """The head's :class:`~chunked_entropy.Chunking`, its layer's fields and the per-call defaults, from
    ``config`` (duck-typed) and ``head_kwargs``: built once, when fused log-probs are enabled."""
    unknown = sorted(set(head_kwargs) - set(_CHUNKING_KEYS) - set(_LAYER_KEYS) - set(_CALL_KEYS))
    if unknown:
        raise TypeError(
            f"enable_fused_log_probs got unexpected keyword argument(s) {unknown}; "
            f"expected some of {list(_CHUNKING_KEYS + _LAYER_KEYS + _CALL_KEYS)}"
        )
    call = {"temperature": 1.0, "compute_entropy": True}
    for key in _CALL_KEYS:
        if config is not None and getattr(config, key, None) is not None:
            call[key] = getattr(config, key)
        if key in head_kwargs:
            call[key] = head_kwargs[key]
    call["temperature"] = _check_temperature(call["temperature"])
    if not isinstance(call["compute_entropy"], bool):
        raise ValueError(f"compute_entropy must be a bool, got {call['compute_entropy']!r}")
    if isinstance(config, ChunkedEntropyConfig):
        chunking = Chunking.from_config(config)
    else:  # duck-typed: the fields present and not None
        chunking = Chunking(**{k: getattr(config, k) for k in _CHUNKING_KEYS if getattr(config, k, None) is not None})
    resolve = getattr(config, "resolve_chunk_size", None)
    if callable(resolve):  # chunk_size="auto": resolved once, for this shard and the fused path
        kw = {"fused": True}
        if "compute_entropy" in inspect.signature(resolve).parameters:
            kw["compute_entropy"] = call["compute_entropy"]
        chunking = chunking.replace(chunk_size=resolve(v_local, **kw))
    chunking = chunking.replace(**{k: head_kwargs[k] for k in _CHUNKING_KEYS if k in head_kwargs})
    return chunking, {k: head_kwargs[k] for k in _LAYER_KEYS if k in head_kwargs}, call


def enable_fused_log_probs(model, config=None, **head_kwargs) -> ChunkedVocabParallelHead:
    """Make a megatron-core ``GPTModel`` return log-probs and entropy through the fused head.

    After this, ``model(input_ids, position_ids, attention_mask, labels=labels)``
    returns a :class:`~chunked_entropy.LogProbsEntropy` of float32 ``[B, S]``
    tensors (entropy None when not computed), identical on every rank of the
    tensor-parallel group; without ``labels`` the model returns its logits as
    before. Per-call options: see :func:`fused_log_probs_options`.

    Args:
        model: a megatron-core ``GPTModel`` (or Megatron's DDP /
            ``Float16Module`` wrapping one) on a stage that has the output
            layer (``post_process=True``), without multi-token prediction.
        config: optional, duck-typed (e.g.
            :class:`chunked_entropy.ChunkedEntropyConfig`): ``chunk_size``
            (or ``resolve_chunk_size(v_local, fused=True)``),
            ``vocab_chunk_size``, ``temperature``, ``compute_entropy``, each
            used when present and not None; a ``ChunkedEntropyConfig`` gives
            the whole :class:`~chunked_entropy.Chunking`
            (:meth:`~chunked_entropy.Chunking.from_config`, its ``backend``
            too). The head's ``Chunking`` and ``OutputLayer`` are built here,
            once.
        **head_kwargs: override the config: ``chunk_size``,
            ``vocab_chunk_size``, ``process_group`` (default: the output
            layer's TP group, else megatron-core's ``parallel_state``),
            ``sequence_parallel`` and ``gradient_accumulation_fusion``
            (default: the output layer's), and the per-call defaults
            ``temperature`` and ``compute_entropy``.

    Returns:
        The head: it shares the output layer's weight (or the tied embedding
        weight), so training through it trains the model.

    A failed call leaves the model exactly as it was; calling it again
    replaces the previous head and defaults.

    Raises:
        TypeError: ``model`` is not a ``GPTModel``, or an unknown keyword argument.
        ValueError: a bad value (named), a stage without the output layer,
            multi-token prediction, or an output layer megatron-core computes
            in MXFP8 (``fp8_output_proj``, megatron-core >= 0.19: the fused
            head would compute it in bf16; the error says what to do).
    """
    gpt = _unwrap(model)
    if not hasattr(gpt, "output_layer") or not (hasattr(gpt, "_postprocess") or _inline_postprocess(gpt)):
        raise TypeError(
            "model must be a megatron-core GPTModel or MambaModel (or a wrapper with .module), got "
            f"{type(model).__name__}"
        )
    if not getattr(gpt, "post_process", True) or gpt.output_layer is None:
        raise ValueError(
            "model has no output layer on this pipeline stage (post_process=False): "
            "enable fused log-probs only where model.post_process is True"
        )
    if getattr(getattr(gpt, "config", None), "mtp_num_layers", None):
        raise ValueError(
            "model uses multi-token prediction (config.mtp_num_layers); the fused head does not support it"
        )
    refuse_fp8_output_layer(getattr(gpt, "config", None), gpt.output_layer, advice=(
        "Keep the model's logits: call it without labels and pass its [S, B, V/tp] logits to "
        "chunked_entropy.log_probs_and_entropy (layer=OutputLayer(process_group=<the TP group>)); or set "
        "fp8_output_proj=False to have the fused head compute the bf16 output layer."))

    weight = None
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        weight = gpt.shared_embedding_or_output_weight()
    shard = weight if weight is not None else getattr(gpt.output_layer, "weight", None)
    if not isinstance(shard, torch.Tensor) or shard.dim() != 2:
        raise TypeError(
            "model.output_layer must be a megatron-core ColumnParallelLinear with a [V/tp, H] weight "
            f"(or the model must share its embedding weight), got {type(gpt.output_layer).__name__}"
        )
    v_local = shard.shape[0]
    chunking, layer_fields, call = _settings(config, head_kwargs, v_local)
    if "process_group" not in layer_fields and getattr(gpt.output_layer, "tp_group", None) is None:
        layer_fields["process_group"] = default_tp_group()
    head = ChunkedVocabParallelHead(OutputLayer.from_megatron(gpt.output_layer, weight=weight, **layer_fields),
                                    chunking)

    previous = gpt.__dict__.get(_STATE)
    hook = _supports_hook(gpt)
    inline = not hook and not hasattr(gpt, "_postprocess")
    names = ("forward",) if hook or inline else ("_postprocess",)
    if previous is not None:
        saved = previous.saved
    else:
        saved = {n: gpt.__dict__.get(n, _MISSING) for n in names}
    state = _State(head=head, hook=hook, saved=saved, **call)
    try:
        if previous is None:
            original = {n: getattr(gpt, n) for n in names}
            if hook:
                gpt.forward = _hooked_forward(gpt, original["forward"])
            elif inline:
                gpt.forward = _inline_forward(gpt, original["forward"])
            else:
                gpt._postprocess = _fused_postprocess(gpt, original["_postprocess"])
        gpt.__dict__[_STATE] = state  # not a submodule: state_dict and parameters are unchanged
    except BaseException:
        if previous is None:
            _restore(gpt, saved)
            gpt.__dict__.pop(_STATE, None)
        raise
    return head


def _restore(gpt, saved):
    for name, value in saved.items():
        if value is _MISSING:
            gpt.__dict__.pop(name, None)
        else:
            gpt.__dict__[name] = value


def disable_fused_log_probs(model) -> bool:
    """Undo :func:`enable_fused_log_probs`; returns False when it was not enabled."""
    gpt = _unwrap(model)
    state = getattr(gpt, "__dict__", {}).get(_STATE)
    if state is None:
        return False
    _restore(gpt, state.saved)
    del gpt.__dict__[_STATE]
    return True


@contextlib.contextmanager
def fused_log_probs_options(model, *, temperature=None, compute_entropy=None, label_mask=None):
    """Per-call options for the forward calls inside the ``with`` block.

    Example:
        >>> with fused_log_probs_options(model, temperature=0.7, label_mask=response_mask):
        ...     log_probs, entropy = model(input_ids, position_ids, attention_mask, labels=labels)
    """
    state = _unwrap(model).__dict__.get(_STATE)
    if state is None:
        raise ValueError("fused log-probs are not enabled on this model: call enable_fused_log_probs(model) first")
    opts = FusedLogProbsOptions(temperature, compute_entropy, label_mask)
    state.options.append(opts)
    try:
        yield opts
    finally:
        state.options.remove(opts)


def _fused_postprocess(gpt, original):
    """The ``_postprocess`` override of megatron-core < 0.18."""

    def _postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        inference = kwargs.get("inference_context") is not None and not gpt.training
        if labels is None or inference or not gpt.post_process:
            return original(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        return _log_probs(gpt, hidden_states, labels, kwargs.get("loss_mask"), None)

    return _postprocess


def _inline_postprocess(model) -> bool:
    """megatron-core's ``MambaModel``: the post-processing inline in ``forward`` (labels, the output layer)."""
    return ({"labels", "runtime_gather_output"} <= _forward_params(model)
            and hasattr(model, "compute_language_model_loss"))


class _Hidden:
    """What the output layer hands on inside :func:`_inline_forward`: the hidden states, not logits."""

    __slots__ = ("hidden",)

    def __init__(self, hidden):
        self.hidden = hidden


def _inline_forward(gpt, original):
    """The ``forward`` of a ``MambaModel`` (post-processing inline): its output layer and loss, on the instance.

    For a call with labels (training, the stage with the output layer), the
    output layer's ``forward`` hands on the hidden states and the model's
    ``compute_language_model_loss(labels, logits)`` returns the fused head's
    :class:`~chunked_entropy.LogProbsEntropy`, both replaced on the instances
    for the duration of the call. The model takes no ``loss_mask``: use the
    ``label_mask`` option.
    """
    sig = inspect.signature(original)

    def forward(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        inference = bound.get("inference_context") is not None and not gpt.training
        if bound.get("labels") is None or inference or not gpt.post_process:
            return original(*args, **kwargs)
        layer = gpt.output_layer
        layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (_Hidden(hidden_states), None)
        gpt.compute_language_model_loss = lambda labels, logits: _log_probs(gpt, logits.hidden, labels, None, None)
        try:
            return original(*args, **kwargs)
        finally:
            del layer.forward
            del gpt.compute_language_model_loss

    return forward


def _hooked_forward(gpt, original):
    """The ``forward`` of megatron-core >= 0.18: pass our ``output_processor`` when labels are given."""

    def forward(*args, **kwargs):
        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
        if bound.get("labels") is not None and bound.get("output_processor") is None:
            kwargs["output_processor"] = lambda **kw: _processor(gpt, **kw)
        return original(*args, **kwargs)

    return forward


def _processor(gpt, *, hidden_states, labels, context=None, loss_mask=None, **_ignored):
    """megatron-core's ``output_processor`` contract: keyword arguments, the result is the forward's."""
    return _log_probs(gpt, hidden_states, labels, loss_mask, context)


def _options(state, context):
    """Per-call options: the processor context, then the innermost ``with`` block, then the defaults."""
    layers = [context] if isinstance(context, FusedLogProbsOptions) else []
    layers += reversed(state.options)
    picked = {}
    for name in ("temperature", "compute_entropy", "label_mask"):
        picked[name] = next((getattr(o, name) for o in layers if getattr(o, name) is not None), None)
    if picked["temperature"] is None:
        picked["temperature"] = state.temperature
    if picked["compute_entropy"] is None:
        picked["compute_entropy"] = state.compute_entropy
    return picked


def _to_sb(name, t, b, s, *, per_sample=True):
    """A [B, S]-layout per-token tensor (or [B] / [B, 1] per sample) in Megatron's [S, B] layout."""
    if not isinstance(t, torch.Tensor) or (per_sample and t.dim() == 0):
        return t
    if per_sample and t.dim() == 1 and t.shape[0] == b:
        return rearrange(t, "b -> 1 b")
    if t.dim() == 2 and (t.shape == (b, s) or (per_sample and t.shape == (b, 1))):
        return rearrange(t, "b s -> s b")
    kinds = "per sample [B] or [B, 1], or per token " if per_sample else ""
    raise ValueError(f"{name} must be {kinds}[B, S] = [{b}, {s}] like labels, got shape {tuple(t.shape)}")


def _log_probs(gpt, hidden_states, labels, loss_mask, context) -> LogProbsEntropy:
    state = gpt.__dict__[_STATE]
    head = state.head
    layer = head.layer
    # The adapter's own checks join an agreed call of the head's group: a rank whose options are refused
    # here raises together with its peers, instead of leaving them in the head's collectives (one more
    # all-gather of CHECK_SLOTS int64 per forward under TP; none without a group).
    with agreed_call(layer.process_group) as call:
        opts = _options(state, context)
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ValueError(f"labels must be a [B, S] tensor of token ids (Megatron's layout), got {shape}")
        b, s = labels.shape
        world = call.world
        s_local = s // world if layer.sequence_parallel else s
        if (hidden_states.dim() != 3 or hidden_states.shape[:2] != (s_local, b)
                or (layer.sequence_parallel and s % world)):
            where = f" (this rank's 1/{world} of the sequence: sequence_parallel)" if layer.sequence_parallel else ""
            raise ValueError(
                f"labels [B, S] = {(b, s)} do not match the decoder's hidden states {tuple(hidden_states.shape)}; "
                f"expected hidden states [S, B, H] with S = {s_local}{where}"
            )
        mask = opts["label_mask"] if opts["label_mask"] is not None else loss_mask
        temperature = _to_sb("temperature", opts["temperature"], b, s)
        mask = None if mask is None else _to_sb("label_mask", mask, b, s, per_sample=False).bool()
    out = head(
        hidden_states,
        rearrange(labels, "b s -> s b"),
        temperature=temperature,
        compute_entropy=opts["compute_entropy"],
        label_mask=mask,
    )
    to_bs = lambda t: None if t is None else rearrange(t, "s b -> b s").contiguous()  # noqa: E731
    return LogProbsEntropy(to_bs(out.log_probs), to_bs(out.entropy))
