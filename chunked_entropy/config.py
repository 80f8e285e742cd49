"""Settings of the chunked computation, readable from an RL framework's actor config.

:class:`ChunkedEntropyConfig` holds what a framework integration needs: the
chunk size (fixed, or derived from a memory budget), vocabulary blocking for
the fused head, the sampling temperature and whether the entropy is computed.
:meth:`ChunkedEntropyConfig.from_actor_config` builds one from a verl-style
actor section (a dict or an OmegaConf ``DictConfig``), so that a verl user
sets it with a Hydra override such as
``+actor_rollout_ref.actor.chunked_entropy.chunk_size=1024``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Optional, Union

#: Bytes per element of the per-chunk buffers (they are float32).
_BUFFER_ITEMSIZE = 4

#: The sub-key of an actor section that holds this library's settings.
SECTION = "chunked_entropy"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_field(name: str, key: str, value):
    """Check one field's value; ``key`` names it in the error (a field or a config path)."""
    if name == "chunk_size":
        if value == "auto" and isinstance(value, str):
            return value
        if not (_is_int(value) and value >= 1):
            raise ValueError(f"{key} must be an int >= 1 or 'auto', got {value!r}")
        return int(value)
    if name in ("max_chunk_bytes", "vocab_chunk_size"):
        if name == "vocab_chunk_size" and value is None:
            return None
        if not (_is_int(value) and value >= 1):
            extra = " or None" if name == "vocab_chunk_size" else ""
            raise ValueError(f"{key} must be an int >= 1{extra}, got {value!r}")
        return int(value)
    if name in ("fused_head", "compute_entropy"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be a bool (true/false), got {value!r}")
        return value
    if name == "temperature":
        if not (_is_real(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"{key} must be a finite float > 0, got {value!r}")
        return float(value)
    raise AssertionError(name)  # pragma: no cover - every field is listed above


@dataclasses.dataclass(frozen=True)
class ChunkedEntropyConfig:
    """How the library chunks the computation of log-probs and entropy.

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

    Raises:
        ValueError: a field has a bad value; the message names the field.

    Example:
        >>> cfg = ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=2**28)
        >>> cfg.resolve_chunk_size(32_000)  # 2**28 // (2 buffers * 4 bytes * 32000)
        1048
    """

    chunk_size: Union[int, str] = 1024
    max_chunk_bytes: int = 1 << 30
    vocab_chunk_size: Optional[int] = None
    fused_head: bool = False
    temperature: float = 1.0
    compute_entropy: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check_field(f.name, f.name, getattr(self, f.name)))

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
        if not (_is_int(v_local) and v_local >= 1):
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
        return max(1, self.max_chunk_bytes // (buffers * _BUFFER_ITEMSIZE * width))

    @classmethod
    def from_actor_config(cls, cfg) -> "ChunkedEntropyConfig":
        """Build the config from an RL framework's actor section.

        ``cfg`` is a dict or an OmegaConf ``DictConfig`` (any mapping) like
        verl's ``actor_rollout_ref.actor``. The fields of this class are read
        at that level or under a ``chunked_entropy:`` sub-key (the same field
        in both places must agree). Whether the entropy is computed comes, in
        this order, from ``compute_entropy``, verl's ``calculate_entropy``,
        or ``entropy_coeff != 0`` (verl's rule for the policy update); it
        stays True when none is present. Other keys are ignored; an unknown
        key *under* ``chunked_entropy:`` is an error (a typo would otherwise
        be silently dropped).

        Args:
            cfg: the actor section.

        Returns:
            The config.

        Raises:
            TypeError: ``cfg`` (or its ``chunked_entropy`` entry) is not a mapping.
            ValueError: a bad or unknown value; the message names its key,
                e.g. ``chunked_entropy.chunk_size``.

        Example:
            >>> ChunkedEntropyConfig.from_actor_config(
            ...     {"entropy_coeff": 0.0, "chunked_entropy": {"chunk_size": 512}}
            ... )
            ChunkedEntropyConfig(chunk_size=512, max_chunk_bytes=1073741824, vocab_chunk_size=None, fused_head=False, temperature=1.0, compute_entropy=False)
        """
        if not isinstance(cfg, Mapping):
            raise TypeError(
                f"cfg must be a dict or an OmegaConf DictConfig holding an actor section, got {type(cfg).__name__}"
            )
        sub = cfg[SECTION] if SECTION in cfg else None
        if sub is None:
            sub = {}
        if not isinstance(sub, Mapping):
            raise TypeError(f"{SECTION} must be a mapping of settings, got {type(sub).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in sub if k not in names | {"calculate_entropy"})
        if unknown:
            raise ValueError(
                f"{SECTION}.{unknown[0]} is not a setting of chunked_entropy; expected one of {sorted(names)}"
            )

        def read(name: str, check):
            """The value of ``name`` at the top level or under the sub-key (checked), or None."""
            found = {}
            if name in cfg:
                found[name] = check(name, cfg[name])
            if name in sub:
                found[f"{SECTION}.{name}"] = check(f"{SECTION}.{name}", sub[name])
            if len(set(found.values())) > 1:
                (k1, v1), (k2, v2) = found.items()
                raise ValueError(f"{k1}={v1!r} and {k2}={v2!r} disagree; set one of them")
            return next(iter(found.items()), None)

        kwargs = {}
        for name in names:
            hit = read(name, lambda key, value, name=name: _check_field(name, key, value))
            if hit is not None:
                kwargs[name] = hit[1]
        if "compute_entropy" not in kwargs:
            hit = read("calculate_entropy", lambda key, value: _check_field("compute_entropy", key, value))
            if hit is not None:
                kwargs["compute_entropy"] = hit[1]
            elif "entropy_coeff" in cfg:
                coeff = cfg["entropy_coeff"]
                if not (_is_real(coeff) and math.isfinite(coeff)):
                    raise ValueError(f"entropy_coeff must be a finite number, got {coeff!r}")
                kwargs["compute_entropy"] = coeff != 0
        return cls(**kwargs)
