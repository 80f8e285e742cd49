"""verl: a drop-in for the Megatron actor's logits processor.

verl's Megatron actor (``verl/workers/actor/megatron_actor.py``) hands the
model's vocabulary-parallel logits to a ``logits_processor(logits, label,
label_mask)`` that returns ``{"log_probs": ..., "entropy": ...}``. Its own
processor divides the logits by the temperature in place, then, when the
entropy is needed, *clones* the full ``[B, S, V/TP]`` logits because
Megatron's vocab-parallel cross entropy overwrites its input; the entropy and
the cross entropy each save further full-size tensors for backward.

:func:`make_logits_processor` returns a processor with the same contract that
never writes the logits and saves, per token, only one or two float32
statistics (plus a reference to the logits, which the model keeps anyway).

The fused path (no logits at all) lives in
:mod:`chunked_entropy.integrations.megatron`; its ``enable_fused_log_probs``
and ``disable_fused_log_probs`` are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from ..config import ChunkedEntropyConfig
from ..logits import log_probs_and_entropy
from ..parallel import default_tp_group, group_rank_size

__all__ = ["VerlLogitsProcessor", "disable_fused_log_probs", "enable_fused_log_probs", "make_logits_processor"]

_FUSED = ("enable_fused_log_probs", "disable_fused_log_probs")


def __getattr__(name):
    # Imported on first use: the Megatron helper needs megatron-core, this module does not.
    if name in _FUSED:
        from . import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FUSED))


def _temperature(temperature, label: torch.Tensor):
    """A float, a 0-d tensor, a per-sample ``[B]`` tensor (made ``[B, 1]``), or a tensor broadcastable to ``label``."""
    if not isinstance(temperature, torch.Tensor) or temperature.dim() != 1 or label.dim() < 2:
        return temperature  # checked by log_probs_and_entropy
    if temperature.shape[0] != label.shape[0]:
        raise ValueError(
            f"temperature: a 1-D tensor holds one value per sample and must have label.shape[0] = "
            f"{label.shape[0]} entries, got {temperature.shape[0]}; for packed sequences pass a "
            f"per-token tensor shaped like label {tuple(label.shape)}"
        )
    return temperature.view((-1,) + (1,) * (label.dim() - 1))


class VerlLogitsProcessor:
    """verl's Megatron-actor logits processor, chunked; made by :func:`make_logits_processor`.

    Call it as ``processor(logits, label, label_mask)``, exactly where verl
    calls its own; ``temperature=`` and ``compute_entropy=`` override the
    config for one call (verl's ``forward_backward_batch`` knows both per
    call: ``data.meta_info["temperature"]`` and ``calculate_entropy``).

    Attributes:
        config: the :class:`~chunked_entropy.ChunkedEntropyConfig`.
        process_group: the tensor-parallel group given at construction, or
            None (then megatron-core's TP group is looked up at each call).
    """

    def __init__(self, config: ChunkedEntropyConfig, process_group=None):
        self.config = config
        self.process_group = process_group

    def group(self):
        """The TP group the vocabulary is sharded over: the given one, else megatron-core's, else None."""
        return self.process_group if self.process_group is not None else default_tp_group()

    def __call__(
        self,
        logits: torch.Tensor,
        label: torch.Tensor,
        label_mask: Optional[torch.Tensor] = None,
        *,
        temperature=None,
        compute_entropy: Optional[bool] = None,
    ) -> dict:
        """Log-probs of ``label`` and entropy of ``softmax(logits / temperature)``.

        Args:
            logits: ``[B, S, V_local]`` (``[1, T, V_local]`` for packed
                sequences), this rank's vocabulary shard (rank ``r`` holds ids
                ``[r*V_local, (r+1)*V_local)``), any float dtype. Never written:
                no ``div_``, no clone needed.
            label: ``[B, S]`` int64 *global* token ids (the next token at each
                position).
            label_mask: ``[B, S]`` bool, or None (every label counts). Where
                False the log-prob is 0 (verl's ``masked_fill(~label_mask, 0)``)
                and passes no gradient; such labels are not range-checked.
            temperature: None (the config's), a float > 0, a 1-D ``[B]``
                tensor (one temperature per sample), or a tensor broadcastable
                to ``label`` (e.g. ``[B, S]`` per token). It gets no gradient.
            compute_entropy: None (the config's) or a bool.

        Returns:
            ``{"log_probs": [B, S], "entropy": [B, S]}`` float32 (float64 for
            float64 logits); the ``"entropy"`` key only when the entropy is
            computed. The entropy is not masked (verl masks it in its loss).

        Memory:
            Saved for backward: a reference to ``logits`` and one float32 per
            token (two with the entropy). Each chunk allocates one float32
            ``[chunk_size, V_local]`` buffer (two with the entropy), where
            ``chunk_size = config.resolve_chunk_size(V_local, fused=False,
            compute_entropy=compute_entropy)``.
            Backward allocates the logits' gradient and at most two such
            buffers. Forward makes two all-reduces per chunk over the group.
        """
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor [B, S, V_local], got {type(logits).__name__}")
        if not isinstance(label, torch.Tensor):
            raise TypeError(f"label must be a torch.Tensor of int64 token ids, got {type(label).__name__}")
        if logits.dim() < 1 or label.shape != logits.shape[:-1]:
            raise ValueError(
                f"label must have the shape of logits without its last dim, {tuple(logits.shape[:-1])}, "
                f"got {tuple(label.shape)}"
            )
        if label_mask is not None:
            if not isinstance(label_mask, torch.Tensor):
                raise TypeError(f"label_mask must be a bool tensor or None, got {type(label_mask).__name__}")
            if label_mask.dtype.is_floating_point or label_mask.dtype.is_complex:
                raise TypeError(f"label_mask must be a bool tensor, got {label_mask.dtype}")
            if label_mask.shape != label.shape:
                raise ValueError(
                    f"label_mask must have label's shape {tuple(label.shape)}, got {tuple(label_mask.shape)}"
                )
        if compute_entropy is None:
            compute_entropy = self.config.compute_entropy
        elif not isinstance(compute_entropy, bool):
            raise TypeError(f"compute_entropy must be a bool or None, got {compute_entropy!r}")
        temperature = self.config.temperature if temperature is None else _temperature(temperature, label)
        chunk_size = self.config.resolve_chunk_size(logits.shape[-1], fused=False, compute_entropy=compute_entropy)
        log_probs, entropy = log_probs_and_entropy(
            logits,
            label,
            chunk_size=chunk_size,
            temperature=temperature,
            process_group=self.group(),
            compute_entropy=compute_entropy,
            label_mask=label_mask,
        )
        out = {"log_probs": log_probs}
        if compute_entropy:
            out["entropy"] = entropy
        return out

    def __repr__(self) -> str:
        return f"VerlLogitsProcessor(config={self.config!r}, process_group={self.process_group!r})"


def make_logits_processor(config, *, process_group=None) -> VerlLogitsProcessor:
    """A logits processor with verl's Megatron-actor contract, chunked and clone-free.

    Args:
        config: a :class:`~chunked_entropy.ChunkedEntropyConfig`, or the actor
            section itself (a dict or ``DictConfig``, read with
            :meth:`~chunked_entropy.ChunkedEntropyConfig.from_actor_config`).
        process_group: the tensor-parallel group over which the logits are
            sharded. None: megatron-core's TP group when model parallelism is
            initialized (looked up at each call), else the whole vocabulary is
            local.

    Returns:
        A :class:`VerlLogitsProcessor`, called as
        ``processor(logits, label, label_mask)``.

    Example:
        >>> cfg = ChunkedEntropyConfig(chunk_size=256)
        >>> processor = make_logits_processor(cfg)
        >>> logits = torch.randn(2, 6, 50, requires_grad=True)
        >>> label = torch.randint(0, 50, (2, 6))
        >>> mask = torch.ones(2, 6, dtype=torch.bool)
        >>> out = processor(logits, label, mask, temperature=0.7)
        >>> sorted(out), out["log_probs"].shape
        (['entropy', 'log_probs'], torch.Size([2, 6]))
    """
    if isinstance(config, Mapping):
        config = ChunkedEntropyConfig.from_actor_config(config)
    if not isinstance(config, ChunkedEntropyConfig):
        raise TypeError(
            f"config must be a ChunkedEntropyConfig or an actor config mapping, got {type(config).__name__}"
        )
    group_rank_size(process_group)  # a clear error now if the group is unusable
    return VerlLogitsProcessor(config, process_group)
