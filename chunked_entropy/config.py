"""The chunk settings' rules and sizes: how big a chunk and a vocabulary block are, and reading the settings
from an RL framework's actor config.

Layer: the sizing (above the walk's :class:`~chunked_entropy._loop.Plan` and the kernels' choice, below the
option objects and the ops). :func:`walk_plan` is the one place a call's sizes are decided: the chunk, the
forward's and the backward's vocabulary blocks, the kernels and the dtype of their blocks, from the shape,
dtype and device and the :class:`~chunked_entropy.Chunking`; every op (through
:func:`chunked_entropy._call.plan_for`) and ``chunked-entropy plan`` take their plan from it. Its byte budgets
(:data:`CHUNK_BUFFER_BYTES`, :data:`GRAD_BUFFER_BYTES`, :data:`WORKING_BYTES`) and formulas
(:func:`vocab_block_for`, :func:`grad_vocab_block_for`, :func:`auto_chunk_size`, and the fused loss's
working memory, :func:`three_pass_bytes`) are here beside it.

:func:`read_actor_config` reads this library's settings from a verl-style actor
section (a dict, an OmegaConf ``DictConfig`` or a verl config dataclass), so
that a verl user sets them with a Hydra override such as
``+actor_rollout_ref.actor.chunked_entropy.chunk_size=1024``;
:meth:`chunked_entropy.Chunking.from_config` builds the chunking from it.
:func:`check_field` holds the rule of each field. :class:`ChunkedEntropyConfig`
(the same settings with the temperature and the entropy switch) is deprecated:
:class:`~chunked_entropy.Chunking` is the one chunk setting.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Optional, Union

import torch

from ._checks import is_finite_real, is_int, plain_str, value_repr
from ._kernels import BACKENDS, EAGER, choose_kernels
from ._loop import Plan, shard_tiles

#: Bytes per element of the per-chunk buffers (they are float32).
_BUFFER_ITEMSIZE = 4

#: The sub-key of an actor section that holds this library's settings.
SECTION = "chunked_entropy"

#: verl's own key for the entropy chunk size (its engine configs carry it too).
VERL_CHUNK_KEY = "entropy_from_logits_chunk_size"

_FLOAT32_MAX = 3.4028234663852886e38
_ABSENT = object()

#: The most one float32 ``[chunk, block]`` buffer of an op over hidden states takes when ``vocab_chunk_size``
#: is not given (:func:`vocab_block_for`): 128 MiB, a chunk of 1024 rows over a 32768-column shard.
CHUNK_BUFFER_BYTES = 128 * 2**20

#: What a backward over vocabulary blocks outermost (:func:`grad_vocab_block_for`) may hold in its
#: ``[tokens, block]`` gradient buffer.
GRAD_BUFFER_BYTES = 64 * 2**20

#: The default working-memory budget of a call (``Chunking.max_working_bytes``): what the fused loss's
#: three-GEMM-pass walk (:func:`three_pass_bytes`) may hold beyond the inputs and their gradients. 1 GiB: at
#: 8192 tokens x H 4096 x a 151936 vocabulary, TP 8 takes three passes (0.30 GiB of accumulator), TP 1 four.
WORKING_BYTES = 1 << 30


def walk_plan(chunking, *, tokens: int, width: int, dtype: Optional[torch.dtype], device,
              want=None, group=None, sequence_parallel: bool = False, over_logits: bool = False,
              float32_logits: bool = False, bias: bool = False, weight_grad: bool = False,
              buffers: Optional[int] = None, kernels: bool = True, pair=None) -> Plan:
    """How a call walks ``tokens`` tokens and a ``width``-column vocabulary shard: the one place the sizes are
    decided. Every op and ``chunked-entropy plan`` take their :class:`~chunked_entropy._loop.Plan` from here.

    Args:
        chunking: the call's :class:`~chunked_entropy.Chunking`.
        tokens: the call's tokens on this rank (the gathered sequence under sequence parallelism).
        width: ``V_local``, the columns of this rank's shard.
        dtype: the weight's dtype over hidden states (None over given logits: unread).
        device: where the call runs (it chooses the kernels of ``backend="auto"``).
        want: the outputs beyond the log-probs, a :class:`~chunked_entropy._stats.Want` (default: the
            plan's, log-probs and entropy).
        group, sequence_parallel: the layer's tensor-parallel group and sequence parallelism.
        over_logits: a call over given logits: the whole shard is one block (the logits exist already).
        float32_logits: half-precision weights whose blocks are computed in float32 (``logits_dtype``).
        bias: the layer has a bias (its blocks are then float32 for the compiled kernels).
        weight_grad: the weight's gradient is wanted (it sizes the backward's vocabulary block).
        buffers: the float32 ``[chunk, block]`` buffers ``chunk_size="auto"`` is sized for (default one, two
            with a scratch output).
        kernels: choose the kernels of ``chunking.backend`` (False: the eager ones, for a walk without
            compiled kernels, and for sizing alone); ``pair``: a divergence's math, whose kernels are probed too.

    The sizes:

    - ``chunk_size``: ``chunking.chunk_size``, or for ``"auto"`` the most rows whose ``buffers`` float32
      buffers of a block's width fit ``max_chunk_bytes`` (:meth:`Chunking.resolve
      <chunked_entropy.Chunking.resolve>`, :func:`auto_chunk_size`).
    - ``vocab_chunk_size``, the forward's block: over given logits the whole shard; over hidden states
      ``chunking.vocab_chunk_size``, or the whole shard while a float32 ``[chunk, V_local]`` buffer fits
      :data:`CHUNK_BUFFER_BYTES`, else the widest multiple of 128 columns that does (:func:`vocab_block_for`).
    - ``grad_vocab_chunk_size``, the backward's block of half-precision weights whose gradient is wanted
      (walked outermost): as wide as a ``[tokens, block]`` gradient buffer within :data:`GRAD_BUFFER_BYTES`
      allows, no wider than the forward's (:func:`grad_vocab_block_for`); None otherwise (chunks outermost).
    - ``block_dtype``: the weight's half precision where compiled kernels read the matmul's rounded blocks
      (no bias, no float32 logits); None otherwise.

    In the invariant mode (``chunking.invariant``: the shard's tiles, :func:`~chunked_entropy._loop.shard_tiles`,
    refusing a shard that is not a whole number of tiles): the eager kernels (the compiled ones with
    ``backend="compile"``: the Triton kernels cannot honour the mode); over hidden states chunks of a multiple of
    ``Tiles.rows`` (128) rows (rounded down, at least one row tile), forward blocks of whole tiles (at least one),
    the backward chunks outermost and float32 blocks.
    """
    want = Plan.want if want is None else want  # the plan's default
    buffers = 1 + want.scratch if buffers is None else buffers
    tiles = shard_tiles(chunking, width, group)
    vocab = chunking.vocab_chunk_size
    chunk_size = chunking.resolve(width if over_logits else min(vocab or width, width), buffers=buffers)
    backend = chunking.backend if tiles is None else "compile" if chunking.backend == "compile" else "eager"
    chosen = choose_kernels(backend, device, pair=pair) if kernels else EAGER
    if over_logits:
        return Plan(chunk_size=chunk_size, vocab_chunk_size=width, group=group, sequence_parallel=False, want=want,
                    kernels=chosen, tiles=tiles)
    if tiles is not None:
        chunk_size = max(tiles.rows, chunk_size - chunk_size % tiles.rows)
        block = vocab_block_for(vocab, chunk_size, tokens, width)
        block = width if block >= width else max(tiles.width, block - block % tiles.width)
        return Plan(chunk_size=chunk_size, vocab_chunk_size=block, group=group, sequence_parallel=sequence_parallel,
                    want=want, kernels=chosen, float32_logits=float32_logits, tiles=tiles)
    half = dtype in (torch.bfloat16, torch.float16)
    block = vocab_block_for(vocab, chunk_size, tokens, width)
    grad_block = None
    if weight_grad and half:
        grad_block = min(block, grad_vocab_block_for(tokens, width, 4 if float32_logits else dtype.itemsize))
    # compiled kernels read a half-precision block as the matmul wrote it (no float32 copy first) and write its
    # gradient in that dtype; a bias is added in float32 to the rounded product, so its blocks stay float32
    direct = not chosen.in_place and half and not float32_logits and not bias
    return Plan(chunk_size=chunk_size, vocab_chunk_size=block, group=group, sequence_parallel=sequence_parallel,
                want=want, kernels=chosen, float32_logits=float32_logits, block_dtype=dtype if direct else None,
                grad_vocab_chunk_size=grad_block)


def vocab_block_for(vocab_chunk_size: Optional[int], chunk_size: int, n: int, v_local: int) -> int:
    """The vocabulary block of an op over hidden states: ``vocab_chunk_size`` when given (at most ``V_local``);
    else the whole shard while a float32 ``[min(chunk_size, n), V_local]`` buffer fits
    :data:`CHUNK_BUFFER_BYTES`, and otherwise the widest multiple of 128 columns that does (a 152k-column
    vocabulary at 1024 rows a chunk: blocks of 32768, 128 MiB buffers instead of 593 MiB)."""
    if vocab_chunk_size is not None:
        return min(vocab_chunk_size, v_local)
    rows = max(1, min(chunk_size, n))
    if rows * v_local * _BUFFER_ITEMSIZE <= CHUNK_BUFFER_BYTES:
        return v_local
    return min(v_local, max(128, CHUNK_BUFFER_BYTES // (rows * _BUFFER_ITEMSIZE) // 128 * 128))


def auto_chunk_size(max_chunk_bytes: int, buffers: int, width: int) -> int:
    """``chunk_size="auto"``: the most rows whose ``buffers`` float32 ``[rows, width]`` buffers fit the budget."""
    return max(1, max_chunk_bytes // (buffers * _BUFFER_ITEMSIZE * width))


def grad_vocab_block_for(n: int, v_local: int, itemsize: int) -> int:
    """The vocabulary block of a half-precision weight's backward, which walks the blocks outermost: as wide
    as a ``[n, block]`` gradient buffer of ``itemsize``-byte elements allows within :data:`GRAD_BUFFER_BYTES`
    (a multiple of 128 columns, at least 128), at most ``V_local``."""
    block = max(1, GRAD_BUFFER_BYTES // (max(n, 1) * itemsize))
    return min(v_local, max(128, block - block % 128))


def config_section(cfg, path: str, *, optional: bool = True):
    """``cfg`` (an actor config or a section of it, read at ``path``) checked to be a mapping: a dict, an OmegaConf
    ``DictConfig``, one of verl's config dataclasses; None (``optional``) stands for an empty one. A
    ``TypeError`` names ``path`` otherwise: a config that is not one is never read as all defaults."""
    if cfg is None and optional:
        return None
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{path} must be a mapping of settings (a dict, an OmegaConf DictConfig or a verl config "
                        f"dataclass), got {type(cfg).__name__} {cfg!r:.60}")
    return cfg


def config_entry(cfg, key: str, path: str, default=None):
    """``cfg[key]`` of a mapping :func:`config_section` accepted (None: ``default``), ``default`` where the key is
    absent; an OmegaConf ``???`` (a mandatory value never set) is a ``ValueError`` naming ``path``, never read
    as absent."""
    if cfg is None:
        return default
    value = _get(cfg, key, path)
    return default if value is _ABSENT else value


def three_pass_bytes(rows: int, v_local: int, hidden: int, itemsize: int, *, accumulator: bool, buffers: int,
                     native: bool, float32_logits: bool = False) -> int:
    """The working memory of the fused loss's three-GEMM-pass walk, beyond its inputs and their gradients.

    Each chunk of ``rows`` tokens is filled once over the whole ``v_local``-column shard and its gradient
    formed from the same block (:func:`chunked_entropy._loop.loss_grad_blocks`), the weight's gradient summed
    chunk by chunk into a float32 ``[v_local, hidden]`` accumulator. Live at the walk's peak (a chunk's
    gradient matmuls):

    - the accumulator, ``v_local * hidden * 4`` (``accumulator``: half-precision weights whose gradient is
      wanted, without ``main_grad``; float32 weights sum into their gradient itself, and with ``main_grad``
      the call keeps its weight gradient in float32 anyway);
    - ``buffers`` float32 ``[rows, v_local]`` chunk buffers (eager: the block and its ``exp`` scratch, a third
      with a soft-cap; compiled and Triton kernels: the block);
    - half-precision weights: one ``[rows, v_local]`` block of their dtype (the matmul's output, then the
      gradient rounded for the matmuls);
    - the chunk's hidden-state gradient: a float32 ``[rows, hidden]`` accumulator and the matmul's output;
    - the weight-gradient matmul's float32 result: on CUDA (``native``) in row slices of at most
      :data:`GRAD_BUFFER_BYTES`; on a CPU the chunk's hidden rows widened to float32, ``[rows, hidden]``;
    - ``float32_logits`` (``logits_dtype=torch.float32`` with half-precision weights): the weight widened to
      float32 for the chunk's float32 matmuls, ``v_local * hidden * 4``.
    """
    half = itemsize != 4
    out = buffers * rows * v_local * _BUFFER_ITEMSIZE
    out += v_local * hidden * 4 if accumulator else 0
    out += rows * v_local * itemsize if half and not float32_logits else 0
    out += rows * hidden * (4 + itemsize)
    if half:
        out += min(v_local * hidden * 4, GRAD_BUFFER_BYTES) if native else rows * hidden * 4
    if float32_logits:
        out += v_local * hidden * 4
    return out


def _get(cfg, key: str, path: str):
    """``cfg[key]``, or ``_ABSENT``; works on dicts, OmegaConf configs and verl's BaseConfig dataclasses.

    (verl's ``BaseConfig`` is a Mapping whose ``__contains__`` raises
    AttributeError for a missing key, so ``key in cfg`` cannot be used.) An
    OmegaConf ``???`` (a mandatory value never set) is an error, not absent.
    """
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with every framework that uses this
        OmegaConf = None
    if OmegaConf is not None and OmegaConf.is_config(cfg) and OmegaConf.is_missing(cfg, key):
        raise ValueError(f"{path} is ??? (a mandatory value that was never set); set it or remove it")
    try:
        return cfg[key]
    except (KeyError, AttributeError):
        return _ABSENT


def check_field(name: str, key: str, value):
    """Check one field's value; ``key`` names it in the error (a field or a config path). A name comes back a
    plain ``str`` (``numpy.str_`` normalized)."""
    value = plain_str(value)
    if name == "chunk_size":
        if value == "auto" and isinstance(value, str):
            return value
        if not (is_int(value) and value >= 1):
            raise ValueError(f"{key} must be an int >= 1 or 'auto', got {value!r}")
        return int(value)
    if name in ("max_chunk_bytes", "max_working_bytes", "vocab_chunk_size"):
        if name == "vocab_chunk_size" and value is None:
            return None
        if not (is_int(value) and value >= 1):
            extra = " or None" if name == "vocab_chunk_size" else ""
            raise ValueError(f"{key} must be an int >= 1{extra}, got {value!r}")
        return int(value)
    if name == "backend":
        if value not in BACKENDS:
            raise ValueError(f"{key} must be one of {', '.join(map(repr, BACKENDS))}, got {value!r}")
        return value
    if name in ("fused_head", "compute_entropy"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be a bool (true/false), got {value!r}")
        return value
    if name == "temperature":
        # the same rule as the functions: 1 / temperature must be finite in float32
        if not (is_finite_real(value) and value > 0 and 1.0 / value < _FLOAT32_MAX):
            raise ValueError(f"{key} must be a finite float > 0 (with 1/temperature finite in float32), got "
                             f"{value_repr(value)}")
        return float(value)
    raise AssertionError(name)  # pragma: no cover - every field is listed above


#: The settings :func:`read_actor_config` reads from an actor section (the fields of the deprecated
#: :class:`ChunkedEntropyConfig`; :class:`~chunked_entropy.Chunking` takes those of them that chunk).
ACTOR_FIELDS = ("chunk_size", "max_chunk_bytes", "vocab_chunk_size", "fused_head", "temperature",
                "compute_entropy", "backend", "max_working_bytes")


@dataclasses.dataclass(frozen=True)
class ChunkedEntropyConfig:
    """Deprecated (0.2.0, removed in 0.3.0): :class:`~chunked_entropy.Chunking` is the one chunk setting.

    ``Chunking(chunk_size, vocab_chunk_size, backend, max_chunk_bytes, max_working_bytes)`` holds its
    chunking and :meth:`Chunking.from_config <chunked_entropy.Chunking.from_config>` reads an actor
    section (or one of these); the temperature and whether the entropy is computed are per-call arguments
    of the ops. Building one warns (``DeprecationWarning``); it keeps working until 0.3.0.

    How the library chunks the computation of log-probs and entropy.

    Attributes:
        chunk_size: tokens per chunk (an int >= 1), or ``"auto"``: the largest
            chunk whose per-chunk buffers fit in ``max_chunk_bytes`` (see
            :meth:`resolve_chunk_size`).
        max_chunk_bytes: the memory budget of the per-chunk buffers, used only
            when ``chunk_size == "auto"``. Default 1 GiB.
        vocab_chunk_size: with the fused head, also block the vocabulary in
            blocks of this many columns (None: the whole shard). The logits
            path ignores it (its logits already exist in full).
        fused_head: compute from hidden states through
            :class:`~chunked_entropy.ChunkedVocabParallelHead` (the lm_head
            matmul folded into the chunk loop) instead of from given logits.
            Integrations read it to choose their path.
        temperature: the sampling temperature the logits are divided by.
        compute_entropy: compute the entropy as well as the log-probs (two
            buffers per chunk instead of one).
        backend: the per-block kernels: ``"auto"`` (default: by device),
            ``"eager"``, ``"compile"`` or ``"triton"`` (see
            :func:`~chunked_entropy.log_probs_and_entropy`).
        max_working_bytes: the working-memory budget of a call, beyond its
            inputs and their gradients (default 1 GiB): the fused loss takes
            three GEMM passes where its walk, a float32 weight-gradient
            accumulator included, fits it, else four (see
            :class:`~chunked_entropy.Chunking`).

    Raises:
        ValueError: a field has a bad value; the message names the field.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     cfg = ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=2**28)
        >>> cfg.resolve_chunk_size(32_000)  # 2**28 // (2 buffers * 4 bytes * 32000)
        1048
    """

    chunk_size: Union[int, str] = 1024
    max_chunk_bytes: int = 1 << 30
    vocab_chunk_size: Optional[int] = None
    fused_head: bool = False
    temperature: float = 1.0
    compute_entropy: bool = True
    backend: str = "auto"
    max_working_bytes: int = WORKING_BYTES

    def __post_init__(self):
        warnings.warn(
            "ChunkedEntropyConfig is deprecated and will be removed in 0.3.0: Chunking is the one chunk setting "
            "(Chunking.from_config(actor_section) reads a framework's config); temperature and compute_entropy "
            "are arguments of the call", DeprecationWarning, stacklevel=3)
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_field(f.name, f.name, getattr(self, f.name)))

    def resolve_chunk_size(
        self, v_local: int, *, fused: Optional[bool] = None, compute_entropy: Optional[bool] = None
    ) -> int:
        """The number of tokens per chunk for a vocabulary shard of ``v_local`` columns.

        An int ``chunk_size`` is returned as is. For ``"auto"``, each chunk
        holds ``buffers`` float32 buffers of ``[chunk_size, width]`` (two when
        the entropy is computed, one otherwise), so

            chunk_size = max(1, max_chunk_bytes // (buffers * 4 * width))

        where ``width`` is ``V_local``, or ``min(vocab_chunk_size, V_local)``
        on the fused path with vocabulary blocking. This bounds the
        ``[chunk, V]`` buffers of forward and backward; the per-token
        statistics and the gradients themselves are not part of the budget.

        Args:
            v_local: columns of this rank's vocabulary shard (``V / TP``).
            fused: whether the fused-head path is used (it alone honours
                ``vocab_chunk_size``); None means ``self.fused_head``.
            compute_entropy: whether this call computes the entropy (two
                buffers); None means ``self.compute_entropy``.

        Returns:
            The chunk size, an int >= 1.
        """
        if not (is_int(v_local) and v_local >= 1):
            raise ValueError(f"v_local must be an int >= 1, got {v_local!r}")
        for name, flag in (("fused", fused), ("compute_entropy", compute_entropy)):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool or None, got {flag!r}")
        if self.chunk_size != "auto":
            return self.chunk_size
        fused = self.fused_head if fused is None else fused
        width = v_local
        if fused and self.vocab_chunk_size is not None:
            width = min(self.vocab_chunk_size, v_local)
        buffers = 2 if (self.compute_entropy if compute_entropy is None else compute_entropy) else 1
        return auto_chunk_size(self.max_chunk_bytes, buffers, width)

    @classmethod
    def from_actor_config(cls, cfg) -> "ChunkedEntropyConfig":
        """Deprecated (0.2.0, removed in 0.3.0): the config of an RL framework's actor section, read by
        :func:`read_actor_config` (the rules are there). ``Chunking.from_config(cfg)`` reads the chunking
        from the same section.

        Example:
            >>> import warnings
            >>> with warnings.catch_warnings():
            ...     warnings.simplefilter("ignore", DeprecationWarning)
            ...     cfg = ChunkedEntropyConfig.from_actor_config(
            ...         {"entropy_coeff": 0.0, "chunked_entropy": {"chunk_size": 512}})
            >>> cfg.chunk_size, cfg.compute_entropy
            (512, False)
        """
        return cls(**read_actor_config(cfg))


def read_actor_config(cfg) -> dict:
    """The settings of an RL framework's actor section, checked, by field name (only those it sets):
    what :meth:`~chunked_entropy.Chunking.from_config` reads.

    ``cfg`` is a dict, an OmegaConf ``DictConfig`` or one of verl's config
    dataclasses (``McoreActorConfig``, ``McoreEngineConfig``: any
    mapping) like verl's ``actor_rollout_ref.actor``. The fields of
    :data:`ACTOR_FIELDS` are read at that level or under a ``chunked_entropy:``
    sub-key (the same field in both places must agree). Without a ``chunk_size``
    there, verl's own ``entropy_from_logits_chunk_size`` is used. Whether
    the entropy is computed comes from ``compute_entropy`` if given, else
    from verl's rule, ``calculate_entropy or entropy_coeff != 0``; absent
    when none is present. Other keys are ignored; an unknown
    key *under* ``chunked_entropy:`` is an error (a typo would otherwise
    be silently dropped), and so is an OmegaConf ``???``.

    Raises:
        TypeError: ``cfg`` (or its ``chunked_entropy`` entry) is not a mapping.
        ValueError: a bad or unknown value; the message names its key,
            e.g. ``chunked_entropy.chunk_size``.

    Example:
        >>> read_actor_config({"entropy_coeff": 0.0, "chunked_entropy": {"chunk_size": 512}})
        {'chunk_size': 512, 'compute_entropy': False}
    """
    if not isinstance(cfg, Mapping):
        raise TypeError(
            "cfg must be a dict, an OmegaConf DictConfig or a verl config dataclass holding an actor "
            f"section, got {type(cfg).__name__}"
        )
    sub = _get(cfg, SECTION, SECTION)
    if sub is _ABSENT or sub is None:
        sub = {}
    if not isinstance(sub, Mapping):
        raise TypeError(f"{SECTION} must be a mapping of settings, got {type(sub).__name__}")
    names = set(ACTOR_FIELDS)
    unknown = sorted(str(k) for k in sub if k not in names | {"calculate_entropy"})
    if unknown:
        raise ValueError(
            f"{SECTION}.{unknown[0]} is not a setting of chunked_entropy; expected one of {sorted(names)}"
        )

    def read(name: str, check):
        """The value of ``name`` at the top level or under the sub-key (checked), or None."""
        found = {}
        for where, key in ((cfg, name), (sub, f"{SECTION}.{name}")):
            value = _get(where, name, key)
            if value is not _ABSENT:
                found[key] = check(key, value)
        if len(set(found.values())) > 1:
            (k1, v1), (k2, v2) = found.items()
            raise ValueError(f"{k1}={v1!r} and {k2}={v2!r} disagree; set one of them")
        return next(iter(found.items()), None)

    kwargs = {}
    for name in ACTOR_FIELDS:
        hit = read(name, lambda key, value, name=name: check_field(name, key, value))
        if hit is not None:
            kwargs[name] = hit[1]
    if "chunk_size" not in kwargs:
        value = _get(cfg, VERL_CHUNK_KEY, VERL_CHUNK_KEY)
        if value is not _ABSENT and value is not None:
            kwargs["chunk_size"] = check_field("chunk_size", VERL_CHUNK_KEY, value)
    if "compute_entropy" not in kwargs:
        # verl's rule: the entropy is computed when asked for or when it enters the loss.
        hit = read("calculate_entropy", lambda key, value: check_field("compute_entropy", key, value))
        coeff = _get(cfg, "entropy_coeff", "entropy_coeff")
        if coeff is not _ABSENT:
            if not is_finite_real(coeff):
                raise ValueError(f"entropy_coeff must be a finite number, got {value_repr(coeff)}")
        if hit is not None or coeff is not _ABSENT:
            kwargs["compute_entropy"] = bool(hit is not None and hit[1]) or (
                coeff is not _ABSENT and coeff != 0
            )
    return kwargs
