"""The settings of an op, as four objects built once and passed whole.

Layer: options (the settings; below the ops, above the math and the loss utilities).
Torch's ``F.linear_cross_entropy(options=LinearCrossEntropyOptions(...))`` and
Cut Cross-Entropy's ``VocabParallelOptions`` set the convention this module
follows: settings that travel together are one frozen object, checked on
construction (each error names its field), and the per-call data (tokens,
labels, masks, temperatures) stays in the call.

- :class:`OutputLayer`: the output layer (its weight shard, bias, logit
  transform, ``logits_dtype``, tensor-parallel group, sequence parallelism,
  ``gradient_accumulation_fusion``). A bare weight tensor is accepted wherever
  one is asked for. Its rules (the weight, the bias, ``logits_dtype``) are checked once, when it is built;
  :meth:`OutputLayer.check_hidden` adds what a call's hidden states must match.
- :class:`Chunking`: how the tokens and the vocabulary are walked
  (``chunk_size``, ``"auto"`` included, ``vocab_chunk_size``, ``backend``).
  An int is accepted wherever one is asked for (the chunk size).
- :class:`PolicyLoss`: the RL loss of the fused policy ops (objective and its
  options, entropy bonus, KL penalty, aggregation).
- :class:`Divergence`: which divergence between a student and a teacher.
  A name (``"forward_kl"``, ...) is accepted wherever one is asked for.

Each has a ``fingerprint()``: the ranks of a tensor-parallel group agree on it
whole, so a new field cannot be left out of the cross-rank check.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
import zlib
from typing import Optional, Union

import torch
from torch import nn

from ._checks import (
    FLOAT_DTYPES,
    ByValue,
    check_device,
    check_flag,
    check_float,
    check_positive,
    check_real,
    float_bits,
    is_int,
    logits_in_float32,
    plain_str,
    same,
)
from ._divergence import KINDS, DivergenceMath, check_kind, kind_names, math_of, trl_kind
from ._stats import ENTROPY_OF, Transform
from .config import (
    WORKING_BYTES,
    ChunkedEntropyConfig,
    auto_chunk_size,
    check_field,
    config_entry,
    config_section,
    read_actor_config,
)
from .losses.aggregation import Aggregation
from .losses.kl import KL_KINDS
from .losses.policy_options import PolicyOptions
from .losses.registry import objective
from .parallel import group_rank_size

__all__ = ["Chunking", "Divergence", "OutputLayer", "PolicyLoss", "model_reader"]

#: The invariant mode's default tile width (``Chunking.tile``), and the widest tile it takes.
INVARIANT_TILE = 1024
MAX_TILE = 32768

#: The entry-point group through which adapters supply the readers of other frameworks' models.
READERS = "chunked_entropy.model_readers"

#: How an :class:`OutputLayer` under construction is named in its errors: ``"OutputLayer."``, or the op
#: argument a bare weight was given as (``"teacher_layer."``).
_PREFIX = contextvars.ContextVar("chunked_entropy_layer_prefix", default="OutputLayer.")


def _crc(values) -> int:
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF




def model_reader(name: str):
    """The model reader registered under ``name`` in the :data:`READERS` entry-point group.

    A reader is ``reader(model, **kw) -> ChunkedVocabParallelHead``. This
    package registers ``huggingface``; another package can register its own
    in its metadata (``[options.entry_points]`` of its ``setup.cfg``).
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group=READERS):
        if ep.name == name:
            return ep.load()
    raise RuntimeError(
        f"no {name!r} model reader is registered in the {READERS!r} entry points: is chunked_entropy installed "
        "(pip install -e .)? Without the package metadata, call "
        "chunked_entropy.integrations.huggingface.head_from_model(model) directly"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class OutputLayer(ByValue):
    """An output layer: what turns hidden states into (this rank's shard of) the logits.

    ``logits = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)``
    (each part optional), over this rank's rows of the vocabulary. The ops over
    hidden states compute it block by block; the ops over given logits read
    only ``softcap``, ``logit_scale`` and ``process_group`` from it (the logits
    already hold the rest), and take it without a weight.

    Attributes:
        weight: ``[V_local, H]`` float tensor (``V_local >= 1``), this rank's vocabulary shard
            (Megatron's output layer, a tied embedding, an ``nn.Linear``
            lm_head); shared, never copied or written. None for the logits ops.
        bias: ``[V_local]`` or None.
        softcap: Gemma 2/3's ``final_logit_softcapping`` (> 0), or None.
        logit_scale: Cohere's ``logit_scale``, Granite's ``1 / logits_scaling`` (> 0), or None.
        logits_dtype: the dtype each block's matmul produces for a bf16/fp16
            weight: None (the weight's own, rounded as the model's layer and a
            vLLM rollout round it) or ``torch.float32`` (kept in float32:
            ``F.linear`` of the upcast operands, on half-precision operands
            with float32 sums where torch has that kernel, CUDA with torch
            >= 2.8, both directions).
        process_group: the tensor-parallel group the vocabulary is sharded
            over (rows of ``weight``), or None.
        sequence_parallel: the hidden states arrive split along dim 0
            (Megatron's ``[S/P, B, H]``); gathered in forward, the gradient
            reduce-scattered back.
        gradient_accumulation_fusion: add the weight gradient to
            ``weight.main_grad`` (float32), as Megatron's layers do; None means
            "when the weight has ``main_grad``".

    Raises:
        TypeError / ValueError: a field has a bad value; the message names it
            (``OutputLayer.softcap``, or the op's argument, e.g.
            ``teacher_layer.weight``, for a bare tensor given there).

    Example:
        >>> lm_head = torch.nn.Linear(16, 50, bias=False)
        >>> layer = OutputLayer.from_linear(lm_head, softcap=30.0)
        >>> layer.weight.shape, layer.softcap
        (torch.Size([50, 16]), 30.0)
        >>> OutputLayer(lm_head.weight, softcap=30.0) == layer.replace(softcap=30)
        True

    Layers compare and hash by their settings, the tensors and the group by identity: the same settings
    over the same weight are equal (a dict key, a cache key), over another weight of the same shape not.
    """

    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    softcap: Optional[float] = None
    logit_scale: Optional[float] = None
    logits_dtype: Optional[torch.dtype] = None
    process_group: object = None
    sequence_parallel: bool = False
    gradient_accumulation_fusion: Optional[bool] = None

    def _key(self) -> tuple:
        return (same(self.weight), same(self.bias), self.softcap, self.logit_scale, self.logits_dtype,
                same(self.process_group), self.sequence_parallel, self.gradient_accumulation_fusion)

    def __post_init__(self):
        p = _PREFIX.get()
        w, b = self.weight, self.bias
        if w is not None:
            check_float(f"{p}weight", w, dim=2)
            if w.shape[0] < 1:
                raise ValueError(f"{p}weight must have at least one row (V_local >= 1), got shape {tuple(w.shape)}")
        if b is not None:
            if w is None:
                raise ValueError(f"{p}bias needs {p}weight (the logits ops take no bias: their logits hold it)")
            check_float(f"{p}bias", b)
            if b.shape != (w.shape[0],):
                raise ValueError(f"{p}bias must have shape ({w.shape[0]},) (V_local), got {tuple(b.shape)}")
            if b.dtype != w.dtype or b.device != w.device:
                raise ValueError(f"{p}bias must have {p}weight's dtype and device ({w.dtype}, {w.device}), got "
                                 f"{b.dtype}, {b.device}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("softcap", check_positive(f"{p}softcap", self.softcap))
        set_("logit_scale", check_positive(f"{p}logit_scale", self.logit_scale))
        dt = self.logits_dtype
        if dt is not None:
            if not isinstance(dt, torch.dtype) or dt not in FLOAT_DTYPES:
                raise ValueError(f"{p}logits_dtype must be None or torch.float32, got {dt!r}")
            if w is not None:
                logits_in_float32(dt, w.dtype, f"{p}logits_dtype", f"{p}weight")
        check_flag(f"{p}sequence_parallel", self.sequence_parallel)
        gaf = self.gradient_accumulation_fusion
        if gaf is not None and not isinstance(gaf, bool):
            raise TypeError(f"{p}gradient_accumulation_fusion must be a bool or None, got {gaf!r}")
        try:
            group_rank_size(self.process_group)  # a clear error now if the group is unusable
        except (TypeError, ValueError) as e:
            raise type(e)(f"{p}process_group: {e}") from None

    def check_hidden(self, hidden, name: str = "hidden") -> bool:
        """This layer prepared for a call over ``hidden`` (``[..., H]``): float, of the weight's hidden size,
        dtype and device, each error naming ``name`` and the weight beside it (``student_hidden``,
        ``student_weight``). The layer's own rules (the weight, the bias, ``logits_dtype``) were checked when it
        was built; this adds only what the hidden states must match. Returns :attr:`float32_logits`."""
        w = name[: -len("hidden")] + "weight" if name.endswith("hidden") else "weight"
        weight = self.weight
        check_float(name, hidden)
        if weight is None:
            raise TypeError(f"{w} must be a torch.Tensor, got NoneType")
        if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"{name} must be [..., H] with H == {w}.shape[1] == {weight.shape[1]}, "
                             f"got shape {tuple(hidden.shape)}")
        if hidden.dtype != weight.dtype:
            raise TypeError(f"{name} ({hidden.dtype}) and {w} ({weight.dtype}) must have the same dtype")
        check_device(name, hidden, weight.device, w)
        return self.float32_logits

    @property
    def float32_logits(self) -> bool:
        """Whether a half-precision weight's blocks are computed in float32 (``logits_dtype=torch.float32``)."""
        return self.weight is not None and logits_in_float32(self.logits_dtype, self.weight.dtype)

    @property
    def transform(self) -> Transform:
        """The logit transform ``softcap * tanh(logit_scale * z / softcap)`` (a ``_stats.Transform``)."""
        return Transform(self.softcap, self.logit_scale)

    @property
    def world_size(self) -> int:
        """The size of the tensor-parallel group (1 without one)."""
        return group_rank_size(self.process_group)[1]

    def replace(self, **changes) -> "OutputLayer":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> dict:
        """What the ranks of the tensor-parallel group must agree on, an int per field: every field but the
        tensors' values (the weight's shape and dtype, whether there is a bias), the group (its size), and
        ``gradient_accumulation_fusion``, each rank's own by contract (where its weight gradient goes, through
        no collective)."""
        w = self.weight
        return {
            "weight (shape, dtype)": -1 if w is None else _crc((tuple(w.shape), str(w.dtype))),
            "bias (given)": int(self.bias is not None),
            "softcap": float_bits(self.softcap),
            "logit_scale": float_bits(self.logit_scale),
            "logits_dtype": _crc(str(self.logits_dtype)),
            "process_group (size)": self.world_size,
            "sequence_parallel": int(self.sequence_parallel),
        }

    @classmethod
    def from_linear(cls, linear: nn.Linear, **changes) -> "OutputLayer":
        """An ``nn.Linear`` lm_head (e.g. a Hugging Face model's): its weight and bias, shared; ``changes``
        set the other fields."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        return cls(weight=linear.weight, bias=linear.bias, **changes)

    @classmethod
    def from_megatron(cls, output_layer, *, weight: Optional[torch.Tensor] = None, **changes) -> "OutputLayer":
        """A megatron-core ``ColumnParallelLinear`` output layer.

        Takes its weight (or ``weight=``, the tied embedding weight, required
        when the layer was built with ``skip_weight_param_allocation``), its
        bias (unless ``skip_bias_add``), its tensor-parallel group,
        ``sequence_parallel`` and ``gradient_accumulation_fusion``;
        ``changes`` override these and set the others.
        """
        for attr in ("tp_group", "sequence_parallel"):
            if not hasattr(output_layer, attr):
                raise TypeError(
                    f"output_layer must be a megatron-core ColumnParallelLinear (missing .{attr}), "
                    f"got {type(output_layer).__name__}"
                )
        if weight is None:
            weight = output_layer.weight
            if weight is None:
                raise ValueError(
                    "output_layer has no weight (skip_weight_param_allocation, tied embeddings): pass "
                    "weight=model.shared_embedding_or_output_weight()"
                )
        fields = dict(
            weight=weight,
            bias=None if getattr(output_layer, "skip_bias_add", False) else getattr(output_layer, "bias", None),
            process_group=output_layer.tp_group, sequence_parallel=bool(output_layer.sequence_parallel),
            gradient_accumulation_fusion=bool(getattr(output_layer, "gradient_accumulation_fusion", False)),
        )
        return cls(**{**fields, **changes})

    @classmethod
    def from_hf_model(cls, model, *, verify: bool = True, **changes) -> "OutputLayer":
        """A Hugging Face causal LM's output layer, with the logit transform its config names.

        The reading is the Hugging Face adapter's
        (:func:`chunked_entropy.integrations.huggingface.head_from_model`,
        registered as the ``huggingface`` reader of the
        ``chunked_entropy.model_readers`` entry points): Gemma 2/3's
        ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
        ``logits_scaling``, checked against a two-token forward of the model
        (``verify``). ``changes`` override what it reads.
        """
        return model_reader("huggingface")(model, verify=verify, **changes).layer


def check_layer_width(layer: OutputLayer, v_local: int, name: str = "layer") -> None:
    """A logits op's ``layer``: a weight, if it holds one, must have the logits' ``V_local`` rows."""
    if layer.weight is not None and layer.weight.shape[0] != v_local:
        raise ValueError(f"{name}.weight has {layer.weight.shape[0]} rows, the logits {v_local} columns (V_local): "
                         "the layer is not the one that made these logits")


def as_layer(value, name: str = "layer", *, logits: bool = False) -> OutputLayer:
    """An op's ``name`` argument as an :class:`OutputLayer`: one as it is, a bare weight tensor wrapped (its
    errors naming ``name``), None (the logits ops only) the default layer."""
    if isinstance(value, OutputLayer):
        return value
    if value is None and logits:
        return OutputLayer()
    if isinstance(value, torch.Tensor) and not logits:
        with errors_named(name):
            return OutputLayer(weight=value)
    what = "an OutputLayer or None" if logits else "an OutputLayer or a [V_local, H] weight tensor"
    raise TypeError(f"{name} must be {what}, got {type(value).__name__}")


@contextlib.contextmanager
def errors_named(name: str):
    token = _PREFIX.set(f"{name}.")
    try:
        yield
    finally:
        _PREFIX.reset(token)


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How an op walks the tokens (and, over hidden states, the vocabulary shard).

    Attributes:
        chunk_size: tokens per chunk, an int >= 1, or ``"auto"``: the largest
            chunk whose float32 ``[chunk, width]`` buffers fit
            ``max_chunk_bytes`` (``width`` the vocabulary block, or the shard),
            resolved per call by :meth:`resolve`.
        vocab_chunk_size: the ops over hidden states also block the vocabulary
            in blocks of this many columns; None: the whole shard while a
            float32 ``[chunk_size, V_local]`` buffer is at most 128 MiB, else
            the widest multiple of 128 columns that is. The logits ops ignore it.
        backend: the per-block kernels, one of :data:`~chunked_entropy.config.BACKENDS`:
            ``"auto"`` (CUDA: Triton, else compiled, else eager, each probed
            once; elsewhere eager), ``"eager"``, ``"compile"``, ``"triton"``.
        max_chunk_bytes: the budget of ``chunk_size="auto"`` (default 1 GiB).
        max_working_bytes: the working-memory budget of a call, beyond its
            inputs and their gradients (default 1 GiB,
            :data:`~chunked_entropy.config.WORKING_BYTES`). The fused loss
            over hidden states (:func:`~chunked_entropy.linear_policy_loss`)
            takes three GEMM passes (logits, ``g @ W``, ``g.T @ h``, each
            chunk's logits formed once over the whole shard) where that
            walk fits it: its float32 ``[V_local, H]`` weight-gradient
            accumulator (half-precision weights), its ``[chunk_size,
            V_local]`` buffers and the rest of
            :func:`~chunked_entropy.config.three_pass_bytes`; otherwise four
            (a statistics pass first; the weight gradient of half-precision
            weights one matmul per vocabulary block, no ``[V_local, H]``
            float32 tensor). ``vocab_chunk_size`` set below ``V_local``
            always takes four. ``chunked-entropy plan`` prints both walks
            and which one a call takes.
        invariant: the invariant mode (docs/exact-tp.md): every output and
            gradient of :func:`~chunked_entropy.log_probs_and_entropy` and
            :func:`~chunked_entropy.linear_log_probs_and_entropy` bitwise the
            same at every tensor-parallel size (1, 2, 4, 8), chunk size,
            ``rows=`` selection and batch a row sits in. The vocabulary is cut
            into global tiles of ``tile`` columns, each tile's statistics
            formed alone and merged in one fixed tree on every rank
            (:mod:`chunked_entropy._tiles`); the fused head's matmuls have
            fixed shapes. Every rank's shard must be a whole number of tiles
            (refused otherwise) and the group's size a power of two. The eager
            kernels (``"auto"`` takes them) or the compiled ones
            (``"compile"``); ``"triton"`` is refused; not with ``keep=``; the
            other ops refuse it. Default False.
        tile: the tile width of the invariant mode, an int in ``[1, 32768]``
            (default 1024; read only with ``invariant``). A tile of at most
            32768 columns is reduced by one thread on the CPU (torch splits a
            longer row across threads, and its sum with them).

    Example:
        >>> Chunking(512).chunk_size
        512
        >>> Chunking("auto", max_chunk_bytes=2**28).resolve(32_000)  # 2**28 // (2 buffers * 4 bytes * 32000)
        1048
    """

    chunk_size: Union[int, str] = 1024
    vocab_chunk_size: Optional[int] = None
    backend: str = "auto"
    max_chunk_bytes: int = 1 << 30
    max_working_bytes: int = WORKING_BYTES
    invariant: bool = False
    tile: int = INVARIANT_TILE

    def __post_init__(self):
        # config.check_field's rules (an actor section's too), each error naming Chunking.<field>
        for f in dataclasses.fields(self):
            if f.name not in ("invariant", "tile"):
                object.__setattr__(self, f.name, check_field(f.name, f"Chunking.{f.name}", getattr(self, f.name)))
        check_flag("Chunking.invariant", self.invariant)
        if not (is_int(self.tile) and 1 <= self.tile <= MAX_TILE):
            raise ValueError(f"Chunking.tile must be an int in [1, {MAX_TILE}] (the invariant mode's tile width), got "
                             f"{self.tile!r}")
        object.__setattr__(self, "tile", int(self.tile))
        if self.invariant and self.backend == "triton":
            raise ValueError("Chunking.backend='triton' cannot honour Chunking.invariant=True: the Triton kernels "
                             "split a row's reduction by its length and the device; the invariant mode runs the eager "
                             "kernels (backend='auto' or 'eager') or the compiled ones (backend='compile')")

    def resolve(self, width: int, *, buffers: int = 2) -> int:
        """The chunk size for ``width`` columns a block (the vocabulary block or shard): ``chunk_size``, or
        for ``"auto"`` ``max(1, max_chunk_bytes // (buffers * 4 * width))``. A call's plan
        (:func:`chunked_entropy.config.walk_plan`, which sizes its vocabulary blocks too) takes its chunk
        size from here."""
        for name, value in (("width", width), ("buffers", buffers)):  # as ChunkedEntropyConfig.resolve_chunk_size
            if not (is_int(value) and value >= 1):
                raise ValueError(f"Chunking.resolve: {name} must be an int >= 1, got {value!r}")
        if self.chunk_size != "auto":
            return self.chunk_size
        return auto_chunk_size(self.max_chunk_bytes, buffers, width)

    def replace(self, **changes) -> "Chunking":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> dict:
        """What the ranks of a tensor-parallel group must agree on: every field, as an int."""
        return {
            "chunk_size": -1 if self.chunk_size == "auto" else self.chunk_size,
            "vocab_chunk_size": -1 if self.vocab_chunk_size is None else self.vocab_chunk_size,
            "backend": _crc(self.backend),
            "max_chunk_bytes": self.max_chunk_bytes,
            "max_working_bytes": self.max_working_bytes,
            "invariant": int(self.invariant),
            "tile": self.tile,
        }

    @classmethod
    def from_config(cls, cfg) -> "Chunking":
        """The chunking of an RL framework's actor section (verl's ``actor_rollout_ref.actor``: its
        ``chunked_entropy:`` sub-key or ``entropy_from_logits_chunk_size``; the rules are
        :func:`~chunked_entropy.config.read_actor_config`'s), or of a deprecated
        :class:`~chunked_entropy.ChunkedEntropyConfig`. The fields the section does not set keep their
        defaults; its ``temperature``, ``compute_entropy`` and ``fused_head`` are checked, not held.

        Example:
            >>> c = Chunking.from_config({"chunked_entropy": {"chunk_size": 512, "vocab_chunk_size": 8192}})
            >>> c.chunk_size, c.vocab_chunk_size, c.backend
            (512, 8192, 'auto')
        """
        if isinstance(cfg, ChunkedEntropyConfig):
            fields = dataclasses.asdict(cfg)
        else:
            fields = read_actor_config(cfg)
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})


def as_chunking(value, name: str = "chunking", *, default: Optional[Chunking] = None,
                invariant_ok: bool = False) -> Chunking:
    """An op's ``chunking`` argument as a :class:`Chunking`: one as it is, an int (or ``"auto"``) as the chunk
    size, None the op's ``default`` (else the defaults). ``invariant_ok``: the op has the invariant mode
    (``Chunking.invariant``); the others refuse it by name."""
    if isinstance(value, Chunking):
        if value.invariant and not invariant_ok:
            raise ValueError(f"{name}.invariant=True: this op has no invariant mode; log_probs_and_entropy and "
                             "linear_log_probs_and_entropy have it (docs/exact-tp.md). Use Chunking(invariant=False) "
                             "here")
        return value
    if value is None:
        return Chunking() if default is None else default
    if is_int(value) or isinstance(value, str):  # numpy ints too, as Chunking itself takes them
        try:
            return Chunking(value)
        except ValueError as e:
            raise ValueError(f"{name} (the chunk size): {e}") from None
    raise TypeError(f"{name} must be a Chunking, an int (the chunk size) or 'auto', got {type(value).__name__}")


def _aggregation(value) -> Aggregation:
    if isinstance(value, Aggregation):
        return value
    if isinstance(value, str):
        return Aggregation(value)
    raise TypeError(f"PolicyLoss.aggregation must be a losses.Aggregation or a mode name, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True, eq=False)
class PolicyLoss(ByValue):
    """The RL loss of the fused policy ops: ``pg - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty)``.

    Attributes:
        mode: the policy objective ``pg``, one of :data:`~chunked_entropy.losses.LOSS_MODES` (verl 0.9.1's
            ``policy_loss.loss_mode`` names; default ``"vanilla"``, PPO's clipped objective).
        options: its settings, a :class:`~chunked_entropy.losses.PolicyOptions` (verl's field names and
            defaults) or a dict of those fields.
        entropy_coeff: the entropy bonus's weight.
        kl_coef: the KL penalty's weight (the ops then need ``ref_log_probs``).
        kl_kind: its estimator, one of :data:`~chunked_entropy.losses.KL_KINDS`.
        aggregation: how each term becomes one number, a :class:`~chunked_entropy.losses.Aggregation` or
            its mode name (``"token-mean"``, ...); the global batch's counts for data parallelism ride in it
            (:meth:`for_batch`).
        entropy_of: the entropy bonus's entropy under sampling replay: ``"full"`` or ``"kept"``.

    Example:
        >>> loss = PolicyLoss("gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        ...                   aggregation="seq-mean-token-mean")
        >>> loss.options.clip_ratio_high, loss.aggregation.mode
        (0.0004, 'seq-mean-token-mean')
        >>> loss.for_batch(dp_size=4, global_batch_size=64).aggregation.dp_size
        4
    """

    mode: str = "vanilla"
    options: PolicyOptions = dataclasses.field(default_factory=PolicyOptions)
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    aggregation: Aggregation = dataclasses.field(default_factory=Aggregation)
    entropy_of: str = "full"

    def _key(self) -> tuple:  # compared and hashed by every field, as fingerprint() covers them
        return (self.mode, self.options, self.entropy_coeff, self.kl_coef, self.kl_kind, self.aggregation,
                self.entropy_of)

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for k in ("mode", "kl_kind", "entropy_of"):  # numpy.str_ and the like: plain names
            set_(k, plain_str(getattr(self, k)))
        opts = self.options
        if isinstance(opts, dict):
            opts = _policy_options(opts)
        elif opts is None:
            opts = PolicyOptions()
        elif not isinstance(opts, PolicyOptions):
            raise TypeError(f"PolicyLoss.options must be a losses.PolicyOptions or a dict of its fields, got "
                            f"{type(opts).__name__}")
        set_("options", opts)
        set_("aggregation", _aggregation(self.aggregation))
        set_("entropy_coeff", check_real("PolicyLoss.entropy_coeff", self.entropy_coeff))
        set_("kl_coef", check_real("PolicyLoss.kl_coef", self.kl_coef))
        if not isinstance(self.kl_kind, str) or self.kl_kind not in KL_KINDS:
            raise ValueError(f"PolicyLoss.kl_kind must be one of {', '.join(map(repr, KL_KINDS))}; got "
                             f"{self.kl_kind!r}")
        if self.entropy_of not in ENTROPY_OF:
            raise ValueError(f"PolicyLoss.entropy_of must be one of {ENTROPY_OF}, got {self.entropy_of!r}")
        try:
            objective(self.mode, self.options)  # an unknown mode, or dro without dro_beta, is named now
        except ValueError as e:
            raise ValueError(f"PolicyLoss.mode: {e}") from None

    def replace(self, **changes) -> "PolicyLoss":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def for_batch(self, *, dp_size: int = 1, batch_num_tokens=None, global_batch_size=None) -> "PolicyLoss":
        """This loss over a global batch split across ``dp_size`` data-parallel ranks: the counts verl's
        ``agg_loss`` takes (see :class:`~chunked_entropy.losses.Aggregation`), set once per step."""
        a = self.aggregation
        return self.replace(aggregation=Aggregation(a.mode, a.loss_scale_factor, dp_size, batch_num_tokens,
                                                    global_batch_size))

    def fingerprint(self) -> dict:
        """What the ranks of a tensor-parallel group must agree on: every field (the options and the
        aggregation whole, the counts' values too)."""
        return {
            "mode": _crc(self.mode),
            "options": self.options.fingerprint(),
            "entropy_coeff": float_bits(self.entropy_coeff),
            "kl_coef": float_bits(self.kl_coef),
            "kl_kind": _crc(self.kl_kind),
            "aggregation": self.aggregation.fingerprint(),
            "entropy_of": _crc(self.entropy_of),
        }

    @classmethod
    def from_actor_config(cls, config, **changes) -> "PolicyLoss":
        """The loss of a verl 0.9.1 actor config (``actor_rollout_ref.actor``: an ``ActorConfig``, an OmegaConf
        node or a dict): ``policy_loss.loss_mode``, the objective's options
        (:meth:`~chunked_entropy.losses.PolicyOptions.from_actor_config`), ``entropy_coeff``,
        ``use_kl_loss`` / ``kl_loss_coef`` / ``kl_loss_type``, ``loss_agg_mode`` and ``loss_scale_factor``.
        Fields it lacks (or holds as None) keep verl's defaults; ``changes`` override. A config (or its
        ``policy_loss``) that is not a mapping is a ``TypeError``, an OmegaConf ``???`` a ``ValueError``, each
        naming the key: neither is read as the defaults.

        Example:
            >>> PolicyLoss.from_actor_config({"policy_loss": {"loss_mode": "gspo"}, "use_kl_loss": True,
            ...                               "kl_loss_coef": 0.01, "loss_agg_mode": "seq-mean-token-mean"}).kl_coef
            0.01
        """
        def get(node, key, default=None, where=""):
            value = config_entry(node, key, where + key)
            return default if value is None else value

        config = config_section(config, "config", optional=False)
        policy = config_section(get(config, "policy_loss"), "policy_loss")
        kl_coef = get(config, "kl_loss_coef", 0.0)  # read (a ??? refused) whether or not use_kl_loss is on
        fields = dict(
            mode=get(policy, "loss_mode", "vanilla", "policy_loss."),
            options=PolicyOptions.from_actor_config(config),
            entropy_coeff=get(config, "entropy_coeff", 0.0),
            kl_coef=kl_coef if get(config, "use_kl_loss", False) else 0.0,
            kl_kind=get(config, "kl_loss_type", "low_var_kl"),
            aggregation=Aggregation(get(config, "loss_agg_mode", "token-mean"), get(config, "loss_scale_factor")),
        )
        return cls(**{**fields, **changes})


def as_loss(value, name: str = "loss") -> PolicyLoss:
    """An op's ``loss`` argument as a :class:`PolicyLoss`: one as it is, None the defaults (verl's vanilla PPO)."""
    if isinstance(value, PolicyLoss):
        return value
    if value is None:
        return PolicyLoss()
    raise TypeError(f"{name} must be a PolicyLoss or None, got {type(value).__name__}")


def _policy_options(fields: dict) -> PolicyOptions:
    known = PolicyOptions.__dataclass_fields__
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"PolicyLoss.options: unknown field(s) {unknown}; the fields are {sorted(known)}")
    return PolicyOptions(**fields)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Which divergence between a student's distribution ``p_s`` and a teacher's ``p_t``, per token.

    Attributes:
        kind: ``"forward_kl"`` (``KL(p_t || p_s)``, the default), ``"reverse_kl"`` (``KL(p_s || p_t)``) or
            ``"jsd"`` (the generalized Jensen-Shannon divergence with mixture ``beta * p_t + (1 - beta) * p_s``).
        beta: the JSD's mixture weight in (0, 1); None for the KLs.

    The one object that names a divergence, from the ops down to the math: :attr:`math` is the kind's
    :class:`~chunked_entropy._divergence.DivergenceMath`. The kinds are the subclasses of that class, each
    registered under its ``kind`` when defined (:data:`~chunked_entropy._divergence.KINDS`): a new divergence
    is one class, and this one, its errors and the ops accept it by name.

    ``replace(**changes)`` gives a copy, checked again, as the other option objects' does. Option objects
    compare and hash by value, as dataclasses do (``Divergence("jsd", 0.5) == Divergence("jsd", 0.5)``).

    TRL's ``GKDTrainer`` names the same three with one number, its ``beta``:
    0 the forward KL, 1 the reverse KL, in between the JSD; :meth:`from_trl_beta` maps it.

    Example:
        >>> Divergence.from_trl_beta(0.5)
        Divergence(kind='jsd', beta=0.5)
        >>> Divergence.from_trl_beta(0.0).kind
        'forward_kl'
    """

    kind: str = "forward_kl"
    beta: Optional[float] = None

    def __post_init__(self):
        object.__setattr__(self, "kind", plain_str(self.kind))
        object.__setattr__(self, "beta", check_kind(self.kind, self.beta))  # checked (and named) there

    def replace(self, **changes) -> "Divergence":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def math(self) -> DivergenceMath:
        """The kind's math (:class:`~chunked_entropy._divergence.DivergenceMath`, registered in
        :data:`~chunked_entropy._divergence.KINDS`): one object per kind and ``beta`` in the process."""
        return math_of(self.kind, self.beta)

    @property
    def needs_aux(self) -> bool:
        """Whether the gradient reads a per-row sum beyond the log-sum-exps (reverse KL: ``D``; JSD: ``K``)."""
        return KINDS[self.kind].needs_aux

    @property
    def spec(self) -> "Divergence":
        """Deprecated (0.2.0): the divergence itself; ``DivergenceSpec`` folded into :class:`Divergence`."""
        warnings.warn("Divergence.spec is deprecated and will be removed in 0.3.0: the Divergence is its own "
                      "spec (DivergenceSpec folded into Divergence)", DeprecationWarning, stacklevel=2)
        return self

    def fingerprint(self) -> dict:
        """What the ranks of a tensor-parallel group must agree on."""
        return {"kind": _crc(self.kind), "beta": float_bits(self.beta)}

    @classmethod
    def from_trl_beta(cls, beta) -> "Divergence":
        """TRL's convention: ``beta`` 0 the forward KL, 1 the reverse KL, in between the generalized JSD."""
        return cls(*trl_kind(beta))


def as_divergence(value, name: str = "divergence") -> Divergence:
    """An op's ``divergence`` argument as a :class:`Divergence`: one as it is, a name as its kind."""
    if isinstance(value, Divergence):
        return value
    if value is None:
        return Divergence()
    if isinstance(value, str):
        return Divergence(value)
    raise TypeError(f"{name} must be a Divergence or the name of one ({kind_names()}), got "
                    f"{type(value).__name__}")
