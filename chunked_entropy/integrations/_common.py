"""What the adapters share: checks of the tensors other frameworks hand over, and patching their modules.

Adapters sit apart from the core and import it as users do; this module is
theirs alone. :class:`Patch` replaces functions in another framework's
modules (verl, slime, Miles) without editing them: checked first, all or
nothing, now or when the module is imported.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import inspect
import logging
import numbers
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .._checks import check_chunk, require
from ..head import ChunkedVocabParallelHead
from ..options import Chunking, OutputLayer

logger = logging.getLogger("chunked_entropy.integrations")


def sharded_over(group) -> Optional[OutputLayer]:
    """The ``layer=`` of a logits op for logits sharded over the tensor-parallel ``group`` (None: not sharded,
    the op's default layer)."""
    return None if group is None else OutputLayer(process_group=group)


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor (..., num_classes), got {type(logits).__name__}")
    if logits.is_nested:  # its shape is not readable (torch raises an internal error): named here
        raise TypeError("logits must be a dense tensor (..., num_classes), got a nested tensor: pass its packed "
                        "rows (logits.values(), [T, num_classes]) with the ids packed alike")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (..., num_classes) with num_classes >= 1, got shape {tuple(logits.shape)}")


def check_chunk_size(chunk_size) -> None:
    """A drop-in's ``chunk_size`` (tokens per chunk): an int >= 1 or ``"auto"``, named as the drop-in's argument
    (the core would name its ``chunking``)."""
    if not (isinstance(chunk_size, str) and chunk_size == "auto"):
        check_chunk("chunk_size", chunk_size)


def engine_chunk_size(engine_config, key: str = "entropy_from_logits_chunk_size") -> int:
    """A framework engine's chunk size (verl's ``engine_config.entropy_from_logits_chunk_size``): an int >= 1,
    else a ValueError naming the key (``int()`` of None or ``"abc"`` would name nothing)."""
    value = getattr(engine_config, key, None)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"engine_config.{key} must be an int >= 1 (the tokens per chunk), got {value!r}")
    return int(value)


def check_ids(name: str, ids, logits) -> None:
    """``ids`` must be an id tensor shaped like ``logits`` without its last dim (named in the error)."""
    check_id_dtype(name, ids)
    if ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"{name} must have the shape of logits without its last dim, {tuple(logits.shape[:-1])}, "
            f"got {tuple(ids.shape)}"
        )


def check_id_dtype(name: str, ids) -> None:
    """``ids`` must be a tensor of integer ids (named in the error)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 ids, got {type(ids).__name__}")
    if ids.is_nested:
        raise TypeError(f"{name} must be a dense tensor of int64 ids, got a nested tensor: pass its packed values "
                        f"({name}.values()) with the logits packed alike")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer ids (int64), got {ids.dtype}")


def check_id_range(name: str, ids: torch.Tensor, num_classes: int) -> None:
    """Every id in ``[0, num_classes)``, as a gather over the classes requires (named in the error).

    A value check (:func:`chunked_entropy._checks.require`): read on the host at once, one sync on an
    accelerator, so that the gather after it never sees a bad id (a device-side assert would lose the CUDA
    context); with ``CHUNKED_ENTROPY_CHECKS=async`` a device-side assertion instead.
    """
    bad = (ids < 0) | (ids >= num_classes)
    expected = f"{name} must hold class ids in [0, {num_classes})"

    def found():  # read only once the check failed
        i = int(bad.reshape(-1).nonzero()[0, 0])
        return f"{expected}; found {int(ids.reshape(-1)[i])} at flat position {i}"

    found.summary = expected
    require(~bad.any(), found)


# ----------------------------------------------------------------------------- megatron-core's FP8 output layer

#: megatron-core >= 0.19's class of the output layer under ``TransformerConfig.fp8_output_proj``.
FP8_OUTPUT_LAYER = "TELMHeadColumnParallelLinear"


def fp8_output_layer(config=None, output_layer=None) -> bool:
    """Whether megatron-core computes the output layer in MXFP8: ``config.fp8_output_proj`` truthy (on the
    model's config or the layer's own), or the layer is Transformer Engine's ``TELMHeadColumnParallelLinear``.

    megatron-core >= 0.19 (``TransformerConfig.fp8_output_proj``, validated to come with ``fp8`` set and
    ``fp8_recipe='mxfp8'``) builds the output layer as ``TELMHeadColumnParallelLinear`` and runs it under
    Transformer Engine's MXFP8 autocast: both operands quantized in blocks of 32 with a shared power-of-two
    scale. Earlier megatron-core has no such field; duck-typed, so any config carrying it counts.
    """
    configs = (config, getattr(output_layer, "config", None))
    return (any(c is not None and bool(getattr(c, "fp8_output_proj", False)) for c in configs)
            or type(output_layer).__name__ == FP8_OUTPUT_LAYER)


def refuse_fp8_output_layer(config=None, output_layer=None, *, advice: str) -> None:
    """A ValueError when :func:`fp8_output_layer` holds, saying why and ``advice`` (what to do instead).

    The fused head computes the logits from the layer's weight in the weight's dtype (bf16), not in MXFP8 as
    the model does: the log-probs, the entropy and every gradient would belong to another head than the one
    the model runs (and samples with), without a word. Raised where an adapter would build the fused head
    (before any of its work); the config is the same object on every rank, so every rank raises.
    """
    if fp8_output_layer(config, output_layer):
        raise ValueError(
            "megatron-core's TransformerConfig.fp8_output_proj is set (megatron-core >= 0.19): the model computes "
            f"its output layer in MXFP8 ({FP8_OUTPUT_LAYER} under Transformer Engine's MXFP8 autocast), and the "
            "fused head would compute it in bf16 from the weight instead, so the log-probs, entropy and gradients "
            f"would not be the model's. {advice}"
        )


# ----------------------------------------------------------------------------- one head per model


class MegatronHeads:
    """The fused head of each megatron-core output layer, built once and reused while it still fits.

    ``head(output_layer, weight=..., chunking=...)`` returns the
    :class:`~chunked_entropy.ChunkedVocabParallelHead` built by
    :meth:`~chunked_entropy.ChunkedVocabParallelHead.from_megatron` the first
    time, and the same head on later calls while the weight is the same
    tensor over the same storage (a weight moved by an offload, or a new
    tied weight, builds a new head) and ``chunking`` and ``detach`` are the
    same. ``detach``: the weight and bias are detached (no gradient reaches
    them; ``gradient_accumulation_fusion`` off), as verl's MTP heads are.

    Held by weak reference to the output layer: a model that is freed frees
    its head. Memory: a head holds references only (no copy of the weight).

    An output layer that megatron-core computes in MXFP8 (``fp8_output_proj``,
    megatron-core >= 0.19) is refused (:func:`refuse_fp8_output_layer`): every
    adapter that builds a head here serves the bf16 layer only.
    """

    def __init__(self):
        self._held = weakref.WeakKeyDictionary()  # output layer -> (key, head)
        self._lock = threading.Lock()

    @staticmethod
    def _key(output_layer, weight, chunking, detach):
        bias = getattr(output_layer, "bias", None)
        where = lambda t: None if t is None else (id(t), t.data_ptr(), t.device, t.dtype, tuple(t.shape))  # noqa: E731
        return (where(weight), where(bias), chunking, detach, bool(getattr(output_layer, "sequence_parallel", False)),
                id(getattr(output_layer, "tp_group", None)))

    def head(self, output_layer, *, weight=None, chunking: Chunking, detach: bool = False) -> ChunkedVocabParallelHead:
        refuse_fp8_output_layer(output_layer=output_layer, advice=(
            "Keep megatron-core's logits: on this adapter's logits route the library reads the MXFP8 layer's "
            "logits (chunked); or set fp8_output_proj=False to have the fused head compute the bf16 output layer."))
        weight = output_layer.weight if weight is None else weight
        key = self._key(output_layer, weight, chunking, detach)
        with self._lock:
            held = self._held.get(output_layer)
            if held is not None and held[0] == key:
                return held[1]
        fields = {}
        if detach:
            layer_bias = getattr(output_layer, "bias", None)
            use_bias = layer_bias is not None and not getattr(output_layer, "skip_bias_add", False)
            weight = weight.detach()
            fields = dict(bias=layer_bias.detach() if use_bias else None, gradient_accumulation_fusion=False)
        head = ChunkedVocabParallelHead.from_megatron(output_layer, weight=weight, chunking=chunking, **fields)
        with self._lock:
            self._held[output_layer] = (key, head)
        return head


# ----------------------------------------------------------------------------- patching another framework's modules


@dataclass(frozen=True)
class Target:
    """One attribute to replace: ``holder(module).attr = replacement``, after ``check(original)`` passed.

    ``holder`` gives the object that holds the attribute (the module itself,
    or a class in it); ``check`` raises when the original does not have the
    contract the replacement was written for.
    """

    module: str
    attr: str
    replacement: Callable
    check: Callable[[object], None]
    holder: Callable[[object], object] = lambda module: module


class Patch:
    """Replacements in another framework's modules, without editing them; all or nothing.

    :meth:`install` checks every target whose module is imported, then (only
    if all pass) replaces them; the targets of modules not imported yet are
    replaced as soon as those are (a post-import hook: the plugin never
    imports them itself). A failed check raises and leaves the framework as
    it was. One log line says what was patched.
    """

    def __init__(self, name: str, targets, message: str):
        self.name, self.targets, self.message = name, tuple(targets), message
        self._lock = threading.RLock()
        self._originals = {}  # id of the target -> (holder, original)
        # (attribute, replacement) -> the framework's own function, the first seen: two routes may replace
        # attributes of one name (verl's engines each have a forward_step) with functions of their own
        self._own = {}
        self._hook = None
        self._logged = False

    def installed(self) -> bool:
        """Whether any target is currently replaced."""
        return bool(self._originals)

    def active(self) -> bool:
        """Whether installed, or waiting for a module's import to replace its targets."""
        return self.installed() or self._hook is not None

    def original(self, attr: str):
        """The framework's own function replaced under ``attr`` (the first target of that name; None before it
        was seen)."""
        return next((f for (name, _), f in self._own.items() if name == attr), None)

    def install(self) -> None:
        with self._lock:
            if self.installed() or self._hook is not None:
                return
            present = [t for t in self.targets if t.module in sys.modules]
            self._apply([(t, sys.modules[t.module]) for t in present])
            pending = {t.module for t in self.targets} - {t.module for t in present}
            if pending:
                self._hook = _PatchOnImport(pending, self._imported)
                sys.meta_path.insert(0, self._hook)

    def uninstall(self) -> None:
        """Put every original back and drop a pending hook."""
        with self._lock:
            self._drop_hook()
            for t in self.targets:
                held = self._originals.pop(id(t), None)
                if held is not None:
                    setattr(held[0], t.attr, held[1])

    def _apply(self, pairs) -> None:
        checked, seen = [], {}
        for t, module in pairs:  # every check first: nothing is replaced unless all pass
            holder = t.holder(module)
            original = getattr(holder, t.attr, None) if holder is not None else None
            if original is None:
                raise RuntimeError(f"chunked_entropy's {self.name} integration needs {t.module}.{t.attr}; this "
                                   f"{self.name} has none. Nothing was patched.")
            key = (t.attr, t.replacement)
            if original is t.replacement:  # imported by name from a module patched already: ours
                original = self._own.get(key, seen.get(key))
                if original is None:
                    continue
            else:
                t.check(original)
                seen.setdefault(key, original)
            checked.append((t, holder, original))
        for key, original in seen.items():
            self._own.setdefault(key, original)
        for t, holder, original in checked:
            self._originals[id(t)] = (holder, original)
            setattr(holder, t.attr, t.replacement)
        if checked and not self._logged:
            self._logged = True
            logger.warning("chunked_entropy: %s", self.message)

    def _imported(self, module) -> None:
        with self._lock:
            self._apply([(t, module) for t in self.targets if t.module == module.__name__])
            if self._hook is not None:
                self._hook.pending.discard(module.__name__)
                if not self._hook.pending:
                    self._drop_hook()

    def _drop_hook(self) -> None:
        if self._hook is not None and self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        self._hook = None


class Adapter:
    """An adapter's ``install`` / ``uninstall`` / ``installed``, over its :class:`Patch`: the one implementation
    behind every adapter's module-level trio (each a documented one-line call of these).

    ``install`` checks every target already imported, then replaces them all,
    and the rest as soon as they are imported (idempotent); on a mismatch it
    raises RuntimeError and leaves the framework as it was. ``uninstall``
    puts every original back and drops a pending hook. ``installed`` says
    whether any target is replaced.
    """

    def __init__(self, patch: Patch):
        self.patch = patch

    def install(self) -> None:
        self.patch.install()

    def uninstall(self) -> None:
        self.patch.uninstall()

    def installed(self) -> bool:
        """Whether any of the framework's functions is currently replaced."""
        return self.patch.installed()


# ----------------------------------------------------------------------------- patching one object's method


class MethodPatch:
    """One method of one object (a trainer) wrapped so that, while it runs, a module attribute of the framework
    is this library's: TRL's trainers, for that trainer only, with nothing changed in TRL's modules after
    the call. One implementation for every such pair of ``patch_*`` / ``unpatch_*``.

    ``patch(obj, make)`` wraps ``obj.<method>`` (on the instance, not the class) so that each call runs with
    ``<module>.<attr>`` set to ``make()``'s value, made once; idempotent (the value already in use is
    returned). ``unpatch(obj)`` undoes it (a no-op on an unpatched object).
    """

    def __init__(self, method: str, module: str, attr: str):
        self.method, self.module, self.attr = method, module, attr

    def patched(self, obj):
        """The value in use on ``obj``, or None when it is not patched."""
        wrapper = obj.__dict__.get(self.method)
        return getattr(wrapper, "chunked_entropy_value", None) if wrapper is not None else None

    def patch(self, obj, make: Callable[[], object]):
        value = self.patched(obj)
        if value is not None:
            return value
        holder = importlib.import_module(self.module)
        value = make()
        original = getattr(obj, self.method)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            previous = getattr(holder, self.attr)
            setattr(holder, self.attr, value)
            try:
                return original(*args, **kwargs)
            finally:
                setattr(holder, self.attr, previous)

        wrapper.chunked_entropy_value = value
        setattr(obj, self.method, wrapper)
        return value

    def unpatch(self, obj) -> None:
        if self.patched(obj) is not None:
            del obj.__dict__[self.method]


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then hands the freshly executed module over."""

    def __init__(self, inner, done):
        self.inner, self.done = inner, done

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.done(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A post-import hook for a set of module names."""

    def __init__(self, pending, done):
        self.pending, self.done = set(pending), done

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self.done)
                return spec
        return None


def check_parameters(where: str, expected: tuple, framework: str) -> Callable[[object], None]:
    """A ``Target.check``: the original's parameters are ``expected`` (names, in order)."""

    def check(original) -> None:
        params = tuple(inspect.signature(original).parameters)
        if params != expected:
            raise RuntimeError(
                f"{where} has the parameters {params}; chunked_entropy's {framework} integration was written for "
                f"{expected}. Nothing was patched."
            )

    return check
