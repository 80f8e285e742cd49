"""AReaL: every policy log-prob and entropy chunked, without a float32 copy of the logits or a saved softmax.

AReaL (inclusionAI/AReaL) computes every training and old/ref log-prob and
entropy through two functions of ``areal.utils.functional.vocab_parallel``,
``gather_logprobs`` and ``gather_logprobs_entropy``, which its FSDP engine,
its Megatron engine, its experimental Archon engine and its tree-attention
module (``areal.models.tree_attn.functional``) import by name. In AReaL
1.0.4 they

- under tensor parallelism: divide a float32 copy of the logits by the
  temperature (``[T, V/tp]``), then save the whole float32 softmax for
  backward (``exp_logits.div_(sum_exp_logits)`` kept in ``ctx``); the
  ``chunk_size`` loop keeps every chunk's softmax, so nothing is bounded;
- at TP 1: run a compiled ``log_softmax`` per chunk, and autograd keeps each
  chunk's graph (a ``[chunk, V]`` float32 tensor per chunk) until backward.

:func:`install` replaces both names wherever AReaL looks them up (the
defining module, the ``areal.utils.functional`` package, the three engines
and the tree-attention module) with :func:`gather_logprobs` and
:func:`gather_logprobs_entropy`: the same arguments and results, computed by
:func:`~chunked_entropy.log_probs_and_entropy` in one chunked pass. The
temperature is applied inside the chunks, the vocabulary is sharded over
AReaL's ``tp_group``, ``chunk_size`` bounds the per-chunk buffers, and
backward recomputes each chunk from a few float32 per token: nothing of size
``[T, V/tp]`` is copied or saved (a reference to the logits, which the model
keeps anyway). The entropy carries its exact gradient, as AReaL's does.

Turn it on in the process that runs the engine, before the first step::

    import chunked_entropy.integrations.areal as ce_areal
    ce_areal.install()

The install checks every target already imported against AReaL's signature
``(logits, labels, temperature, tp_group, chunk_size)``, then replaces all of
them (a mismatch raises and leaves AReaL untouched), and the rest as soon as
AReaL imports them. Written for ``areal==1.0.4``.

Differences from AReaL's own functions: float64 logits give float64 results
(AReaL returns float32 always); a label outside ``[0, V)``, ``-100``
included, is a ValueError naming ``labels`` and the first bad id (AReaL's
gather fails on it at TP 1, and under TP reads it as no label: a log-prob of
minus the log-sum-exp); an empty batch gives empty results (AReaL asserts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..logits import log_probs_and_entropy
from ..parallel import agreed_call
from ._common import (
    Adapter,
    Patch,
    Target,
    check_chunk_size,
    check_id_range,
    check_ids,
    check_logits,
    check_parameters,
    sharded_over,
)

__all__ = ["TARGETS", "gather_logprobs", "gather_logprobs_entropy", "install", "installed", "uninstall"]

#: The AReaL version the replacements were written for (its signatures are checked at install).
AREAL_VERSION = "1.0.4"

_DEFINED = "areal.utils.functional.vocab_parallel"
#: Where AReaL looks ``gather_logprobs`` / ``gather_logprobs_entropy`` up: the defining module, the package that
#: re-exports them, and every module that imports them by name.
TARGETS = (
    _DEFINED,
    "areal.utils.functional",
    "areal.engine.fsdp_engine",
    "areal.engine.megatron_engine",
    "areal.experimental.engine.archon_engine",
    "areal.models.tree_attn.functional",
)
_EXPECTED = ("logits", "labels", "temperature", "tp_group", "chunk_size")


def _group(tp_group):
    """AReaL's rule: the vocabulary is sharded only over a group of more than one rank."""
    return tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None


def _run(logits, labels, temperature, tp_group, chunk_size, compute_entropy: bool):
    group = _group(tp_group)
    # The adapter's own checks join an agreed call: a rank refused here raises with its peers instead of
    # leaving them in the library's collectives (one more small all-gather per call under TP).
    with agreed_call(group):
        check_logits(logits)
        check_ids("labels", labels, logits)
        check_chunk_size(chunk_size)
        # global ids of the whole vocabulary, as AReaL's gather needs (the core would read -100 as no label)
        check_id_range("labels", labels, logits.shape[-1] * (1 if group is None else dist.get_world_size(group)))
    return log_probs_and_entropy(logits, labels, layer=sharded_over(group), chunking=chunk_size,
                                 temperature=temperature, compute_entropy=compute_entropy)


def gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """AReaL's ``gather_logprobs``, chunked: log-prob of ``labels`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V]``, or this rank's vocabulary shard ``[..., V/tp]``
            under ``tp_group``; any float dtype. Never written.
        labels: ``[...]`` int64 global token ids in ``[0, V)`` (any other,
            ``-100`` included, is a ValueError naming ``labels``).
        temperature: a float > 0 (or a tensor broadcastable to ``labels``).
        tp_group: AReaL's tensor-parallel group; the vocabulary is sharded
            over it when it has more than one rank (rank ``r`` holds ids
            ``[r*V/tp, (r+1)*V/tp)``), as in AReaL.
        chunk_size: tokens per chunk.

    Returns:
        ``[...]`` float32 log-probs (float64 for float64 logits).

    Memory:
        Saved for backward: a reference to ``logits`` and two float32 per
        token. Forward allocates one float32 ``[chunk_size, V/tp]`` buffer;
        backward the logits' gradient and at most one such buffer.
    """
    return _run(logits, labels, temperature, tp_group, chunk_size, compute_entropy=False).log_probs


def gather_logprobs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's ``gather_logprobs_entropy``, chunked: the log-probs and the entropy, both with gradients.

    Arguments as :func:`gather_logprobs`.

    Returns:
        ``(logprobs, entropy)``, each ``[...]`` float32 (float64 for float64
        logits); the entropy is of ``softmax(logits / temperature)``.

    Memory:
        Saved for backward: a reference to ``logits`` and three float32 per
        token. Forward allocates two float32 ``[chunk_size, V/tp]`` buffers;
        backward the logits' gradient and at most two such buffers.
    """
    out = _run(logits, labels, temperature, tp_group, chunk_size, compute_entropy=True)
    return out.log_probs, out.entropy


_PATCH = Patch(
    "AReaL",
    [Target(m, name, fn, check_parameters(f"{m}.{name}", _EXPECTED, f"AReaL (written for {AREAL_VERSION})"))
     for m in TARGETS
     for name, fn in (("gather_logprobs", gather_logprobs), ("gather_logprobs_entropy", gather_logprobs_entropy))],
    "AReaL's gather_logprobs and gather_logprobs_entropy now run chunked: the temperature inside the chunks, "
    "no float32 [T, V/tp] copy or saved softmax, the entropy with its gradient",
)


_ADAPTER = Adapter(_PATCH)


def install() -> None:
    """Replace AReaL's ``gather_logprobs`` and ``gather_logprobs_entropy`` everywhere it uses them (idempotent).

    Checks the signature of every target already imported, then replaces
    them all, and the rest as soon as AReaL imports them. On a mismatch it
    raises RuntimeError and leaves AReaL as it was.
    """
    _ADAPTER.install()


def uninstall() -> None:
    """Restore AReaL's own functions everywhere (and drop a pending hook)."""
    _ADAPTER.uninstall()


def installed() -> bool:
    """Whether any of the framework's functions is currently replaced."""
    return _ADAPTER.installed()
