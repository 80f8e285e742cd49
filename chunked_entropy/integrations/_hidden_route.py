"""The hidden-state route of the slime plugin: megatron-core's post-processing hands on the hidden states.

slime's actor calls ``model(input_ids=..., labels=None, loss_mask=...,
packed_seq_params=...)`` and passes what comes back to its loss function or
``get_log_probs_and_entropy``. megatron-core's ``GPTModel._postprocess``
(reached from ``GPTModel.forward``) would project every hidden row to a
``[T, V/tp]`` logits tensor there, which ``Float16Module`` then widens to
float32. :func:`route` serves ``GPTModel._postprocess`` (the class
attribute, so every model slime builds) while the route is on: for slime's
call (no labels, training or log-prob forward, the stage with the output
layer, a vocabulary output layer) it returns a :class:`HiddenStates` instead
of the logits: the decoder's ``[S(/tp), B, H]`` output and the model. Nothing
of size ``[T, V/tp]`` exists; the plugin's ``get_log_probs_and_entropy``
projects only the response rows through the fused head.

``HiddenStates`` is not a tensor, so megatron-core's ``Float16Module`` (which
widens only half-precision tensors) and its pipeline schedules (which hand
the last stage's output to the loss function as it is) pass it on untouched.
slime's own code reads two things of the logits besides handing them to
``get_log_probs_and_entropy``: ``logits.device`` and ``0 * logits.sum()``
(to keep the graph alive on a rank without loss tokens); both are served.

Where the route cannot serve a call it runs megatron-core's own code (the
logits), after one logged warning naming why: multi-token prediction (its
loss is computed inside the post-processing from the logits), combined-1F1B
(``PostProcessNode`` hands its output to autograd-aware schedule nodes that
need a tensor). Calls that are not slime's policy forward run megatron-core's
own code silently: labels given, inference, a stage without the output
layer, a critic's value head (``output_size=1``, not a vocabulary layer).

An output layer that megatron-core computes in MXFP8 (``fp8_output_proj``,
megatron-core >= 0.19) is refused, with a ValueError saying to take the
logits route: at install when the trainer's arguments carry the flag (Megatron's
``--fp8-output-proj``), else at the model's first call on the route. The fused
head would compute that layer in bf16 from its weight: other logits than the
model's, without a word.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types

import torch

from ..head import ChunkedVocabParallelHead
from ..options import Chunking
from ._common import Adapter, MegatronHeads, Patch, Target, logger, refuse_fp8_output_layer

__all__ = ["ROUTES", "HiddenStates", "RoutedAdapter", "check_mamba_forward", "check_postprocess", "mamba_route",
           "postprocess_patch", "route", "warn_once", "why_not"]

_warned: set = set()
_HEADS = MegatronHeads()
_warn_lock = threading.Lock()


def warn_once(reason: str) -> None:
    """One logged warning per reason (per process)."""
    with _warn_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    logger.warning("chunked_entropy: the hidden-state route falls back to the logits: %s", reason)


class HiddenStates:
    """What the patched post-processing returns instead of the ``[B, S, V/tp]`` logits.

    Attributes:
        hidden: the decoder's output ``[S, B, H]`` (``[S/tp, B, H]`` under
            sequence parallelism), after the final layer norm, in the model's
            dtype; its graph leads back through the model.
        model: the megatron-core model whose output layer (or tied embedding)
            projects it.
    """

    __slots__ = ("hidden", "model")

    def __init__(self, hidden: torch.Tensor, model):
        self.hidden, self.model = hidden, model

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def sum(self, *args, **kwargs) -> torch.Tensor:
        """slime's ``0 * logits.sum()``: a scalar on the graph of the hidden states."""
        return self.hidden.sum(*args, **kwargs)

    def __repr__(self) -> str:
        shape, model = tuple(self.hidden.shape), type(self.model).__name__
        return f"HiddenStates(hidden={shape}, {self.hidden.dtype}, model={model})"

    def head(self, chunking: Chunking) -> ChunkedVocabParallelHead:
        """The fused head on the model's output layer (or its tied embedding weight), built once per model
        (:class:`~chunked_entropy.integrations._common.MegatronHeads`)."""
        model = self.model
        weight = None
        if getattr(model, "share_embeddings_and_output_weights", False):
            weight = model.shared_embedding_or_output_weight()
        return _HEADS.head(model.output_layer, weight=weight, chunking=chunking)


def _vocab_layer(model) -> bool:
    layer = getattr(model, "output_layer", None)
    return layer is not None and hasattr(layer, "tp_group") and hasattr(layer, "sequence_parallel")


def _from_schedule_node() -> bool:
    """Whether megatron-core's combined-1F1B ``PostProcessNode.forward_impl`` is among the callers."""
    node = sys.modules.get("megatron.core.models.gpt.fine_grained_callables")
    impl = getattr(getattr(node, "PostProcessNode", None), "forward_impl", None)
    code = getattr(impl, "__code__", None)
    if code is None:
        return False
    frame = sys._getframe(1)
    for _ in range(6):  # route <- the patched _postprocess <- (a wrapper) <- forward_impl
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def why_not(model, labels, inference_context, mtp_in_postprocess, runtime_gather_output):
    """None when the route serves this call; else ``(reason, loud)``: loud reasons are logged once."""
    if labels is not None:
        return "labels were given (megatron-core computes its own loss)", False
    if inference_context is not None and not model.training:
        return "inference", False
    if not getattr(model, "post_process", True) or not _vocab_layer(model):
        return "no vocabulary output layer on this stage (a middle stage, or a value head)", False
    if getattr(getattr(model, "config", None), "mtp_num_layers", None) or mtp_in_postprocess:
        return ("multi-token prediction: megatron-core computes the MTP losses from the logits inside the "
                "post-processing"), True
    if runtime_gather_output:
        return "runtime_gather_output asks for the full-vocabulary logits", True
    return None


def _refuse_fp8(model, framework) -> None:
    """The route's call on a model whose output layer megatron-core computes in MXFP8: refused, saying what to do."""
    refuse_fp8_output_layer(getattr(model, "config", None), getattr(model, "output_layer", None),
                            advice=_fp8_advice(framework))


def _fp8_advice(framework, env=None) -> str:
    where = f" ({env}=logits)" if env else ""
    return (f"Install the {framework or 'trainer'} plugin with route='logits'{where}: megatron-core computes the "
            "MXFP8 logits and the library reads them chunked; or leave fp8_output_proj off (no --fp8-output-proj) to "
            "have the fused head compute the bf16 output layer.")


def route(original, model, args, kwargs, framework=None):
    """``GPTModel._postprocess(*args, **kwargs)``: :class:`HiddenStates` for slime's calls, else ``original``.

    A call the route would serve on a model whose output layer megatron-core computes in MXFP8 is a
    ValueError naming ``fp8_output_proj`` and the logits route (``framework`` names the plugin in it).
    """
    bound = inspect.signature(original).bind(model, *args, **kwargs).arguments
    why = why_not(model, bound.get("labels"), bound.get("inference_context"), bound.get("mtp_in_postprocess"),
                  bound.get("runtime_gather_output"))
    if why is None and _from_schedule_node():
        why = ("combined-1F1B's PostProcessNode (its schedule nodes pass tensors only)", True)
    if why is not None:
        if why[1]:
            warn_once(why[0])
        return original(model, *args, **kwargs)
    _refuse_fp8(model, framework)
    return HiddenStates(bound["hidden_states"], model)


def check_postprocess(original) -> None:
    """A ``Target.check``: megatron-core's ``_postprocess`` takes the decoder's output and the labels by name."""
    params = inspect.signature(original).parameters
    missing = [p for p in ("hidden_states", "labels") if p not in params]
    if missing:
        raise RuntimeError(f"megatron-core's GPTModel._postprocess has no parameter(s) {missing}; the hidden-state "
                           "route was written for megatron-core 0.16 - 0.19. Nothing was patched.")


class _Transposed:
    """The intercepted output layer's "logits": ``MambaModel.forward``'s ``logits.transpose(0, 1).contiguous()``."""

    __slots__ = ("states",)

    def __init__(self, states: HiddenStates):
        self.states = states

    def transpose(self, *dims):
        return self

    def contiguous(self):
        return self.states


def mamba_route(original, model, args, kwargs, framework=None):
    """``MambaModel.forward`` (megatron-core 0.16 - 0.18) / ``HybridModel.forward`` (>= 0.19, the same inline code).

    Its post-processing is inline (no ``_postprocess``): for the calls the
    route serves, the output layer's ``forward`` is replaced on the instance
    for the duration of the call, returning the hidden states where the
    logits would be; the model's ``logits.transpose(0, 1).contiguous()``
    then yields a :class:`HiddenStates`. 0.19's ``HybridModel`` also scales
    the logits for MuP (``_scale_logits``, the identity without
    ``use_mup``): with ``use_mup`` the route falls back, with one warning.
    """
    try:
        bound = inspect.signature(original).bind(model, *args, **kwargs).arguments
    except TypeError:
        return original(model, *args, **kwargs)  # the model's own error
    why = why_not(model, bound.get("labels"), bound.get("inference_context"), None,
                  bound.get("runtime_gather_output"))
    if why is None and _inference_mode_active():
        why = "megatron-core's InferenceMode is active", False
    if why is None and getattr(getattr(model, "config", None), "use_mup", False):
        why = "MuP logit scaling (config.use_mup): the model scales its logits after the output layer", True
    if why is not None:
        if why[1]:
            warn_once(why[0])
        return original(model, *args, **kwargs)
    _refuse_fp8(model, framework)
    layer = model.output_layer

    def forward(hidden_states, weight=None, runtime_gather_output=None):
        return _Transposed(HiddenStates(hidden_states, model)), None

    layer.forward = forward
    try:
        out = original(model, *args, **kwargs)
    finally:
        del layer.forward
    if not isinstance(out, HiddenStates):
        raise RuntimeError(f"{type(model).__name__}.forward did not return the output layer's result as "
                           f"megatron-core 0.16 - 0.19 do (got {type(out).__name__}); uninstall the hidden-state route")
    return out


def _inference_mode_active() -> bool:
    """megatron-core >= 0.19's process-wide ``InferenceMode`` flag (absent before)."""
    utils = sys.modules.get("megatron.core.inference.utils")
    mode = getattr(utils, "InferenceMode", None)
    return bool(mode is not None and mode.is_active())


def check_mamba_forward(original) -> None:
    """A ``Target.check``: ``MambaModel.forward`` takes the labels, the inference context and the gather flag."""
    params = inspect.signature(original).parameters
    missing = [p for p in ("labels", "inference_context", "runtime_gather_output") if p not in params]
    if missing:
        raise RuntimeError(f"megatron-core's MambaModel/HybridModel.forward has no parameter(s) {missing}; the "
                           "hidden-state route was written for megatron-core 0.16 - 0.19. Nothing was patched.")


_GPT = "megatron.core.models.gpt.gpt_model"
_MAMBA = "megatron.core.models.mamba.mamba_model"
_HYBRID = "megatron.core.models.hybrid.hybrid_model"  # megatron-core >= 0.19 (MambaModel its subclass)


def _own_forward(cls, replacement):
    """``cls`` when it defines ``forward`` itself (0.16's MambaModel); else a stand-in holding ``replacement``,
    which :class:`Patch` skips (0.19's MambaModel inherits HybridModel's, patched there)."""
    if "forward" in vars(cls):
        return cls
    return types.SimpleNamespace(forward=replacement)


def postprocess_patch(framework: str) -> Patch:
    """The :class:`Patch` of megatron-core's post-processing for one framework's plugin (on its route).

    ``GPTModel._postprocess``, and ``MambaModel.forward`` (0.16 - 0.18) /
    ``HybridModel.forward`` (>= 0.19, which 0.19's ``MambaModel`` inherits),
    whose post-processing is inline; each when its module is imported.
    """
    patch = None

    def _postprocess(self, *args, **kwargs):
        """megatron-core's ``GPTModel._postprocess``, handing on the hidden states for the framework's calls."""
        return route(patch.original("_postprocess"), self, args, kwargs, framework)

    def hybrid_forward(self, *args, **kwargs):
        """megatron-core's ``HybridModel.forward`` (>= 0.19), handing on the hidden states."""
        return mamba_route(patch._own[("forward", hybrid_forward)], self, args, kwargs, framework)

    def mamba_forward(self, *args, **kwargs):
        """megatron-core's ``MambaModel.forward`` (0.16 - 0.18), handing on the hidden states."""
        return mamba_route(patch._own[("forward", mamba_forward)], self, args, kwargs, framework)

    patch = Patch(
        f"{framework} (hidden-state route)",
        [Target(_GPT, "_postprocess", _postprocess, check_postprocess, holder=lambda m: m.GPTModel),
         Target(_HYBRID, "forward", hybrid_forward, check_mamba_forward, holder=lambda m: m.HybridModel),
         Target(_MAMBA, "forward", mamba_forward, check_mamba_forward,
                holder=lambda m: _own_forward(m.MambaModel, mamba_forward))],
        f"megatron-core's GPTModel/MambaModel post-processing now hands {framework}'s loss and log-prob functions "
        "the hidden states: only the response rows are projected, through the fused head (no [T, V/tp] logits)",
    )
    return patch


#: The routes of the Megatron RL trainers' adapters.
ROUTES = ("hidden", "logits")


#: The trainers' custom loss (``--loss-type custom_loss``): it may read the logits itself, so it keeps them.
_CUSTOM_LOSS = (lambda args: getattr(args, "loss_type", None) == "custom_loss",
                "--loss-type custom_loss (a custom loss may read the logits itself)")


class RoutedAdapter(Adapter):
    """The adapter of a Megatron RL trainer (slime, Miles): its functions' :class:`Patch` and, on the
    hidden-state route, megatron-core's post-processing (``hidden``), installed all or nothing.

    ``install(args, route=)``: ``route`` (else the environment variable
    ``route_env``, else ``"hidden"``) is one of :data:`ROUTES`. On the
    hidden-state route, the first of ``fallbacks`` (``(test(args), reason)``
    pairs), then a custom loss (``--loss-type custom_loss``, which both
    trainers hand the logits and which may read them itself), whose test
    holds turns it into the logits route, with one logged warning naming the
    reason. ``"logits"`` removes a post-processing patch
    left from an earlier install; a failed post-processing patch leaves the
    functions' patch uninstalled too. Arguments that say the output layer
    runs in MXFP8 (``args.fp8_output_proj``, Megatron's ``--fp8-output-proj``,
    megatron-core >= 0.19) refuse the hidden-state route: a ValueError naming
    the flag and the logits route, before anything is patched.
    """

    def __init__(self, patch: Patch, hidden: Patch, *, route_env: str, fallbacks=(), framework: str = "trainer"):
        super().__init__(patch)
        self.hidden, self.route_env = hidden, route_env
        self.fallbacks = (*fallbacks, _CUSTOM_LOSS)
        self.framework = framework

    def install(self, args=None, *, route=None) -> None:
        import os

        route = route if route is not None else os.environ.get(self.route_env, "hidden")
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES} (argument or {self.route_env}), got {route!r}")
        if route == "hidden":
            reason = next((why for test, why in self.fallbacks if test(args)), None)
            if reason is not None:
                warn_once(reason)
                route = "logits"
        if route == "hidden" and getattr(args, "fp8_output_proj", False):
            raise ValueError("args.fp8_output_proj is set (Megatron's --fp8-output-proj, megatron-core >= 0.19): the "
                             "model computes its output layer in MXFP8, and the hidden-state route's fused head would "
                             "compute it in bf16 from the weight, so the log-probs, entropy and gradients would not be "
                             "the model's. " + _fp8_advice(self.framework, self.route_env))
        self.patch.install()
        if route != "hidden":
            self.hidden.uninstall()
            return
        try:
            self.hidden.install()
        except BaseException:
            self.patch.uninstall()
            raise

    def uninstall(self) -> None:
        self.hidden.uninstall()
        self.patch.uninstall()

    def route(self):
        """The route installed: ``"hidden"``, ``"logits"``, or None."""
        if not self.patch.active():
            return None
        return "hidden" if self.hidden.active() else "logits"
