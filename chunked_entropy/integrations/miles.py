"""Miles: the Megatron trainer's log-probs and entropy without per-chunk copies, saved softmaxes or a divided copy.

Miles (radixark/miles) computes every training and old/ref log-prob and
entropy per response in ``loss_hub.logit_processors.get_log_probs_and_entropy``,
which divides the ``[T, V/tp]`` logits by the rollout temperature out of
place (a copy its slices then keep alive until backward) and calls
``loss_hub.math_utils.calculate_log_probs_and_entropy`` on each response's
rows. Outside ``true_on_policy`` mode that function copies every chunk to
float32 twice (Megatron's fused vocab-parallel cross entropy writes its input
in forward, the entropy in backward) and saves each copy's softmax.

:func:`install` replaces, wherever Miles looks them up, without editing Miles:

- ``calculate_log_probs_and_entropy`` (in ``math_utils``, where it is
  defined, and ``logit_processors``, which imports it by name) with
  :func:`calculate_log_probs_and_entropy`: one chunked pass of
  :func:`~chunked_entropy.log_probs_and_entropy`, no copy, no saved softmax;
- ``get_log_probs_and_entropy`` (in ``logit_processors`` and the modules that
  import it by name: ``training_utils.loss``, ``loss_hub.losses``, the
  Megatron and FSDP actors) with :func:`get_log_probs_and_entropy`: Miles's
  own ``get_responses`` slicing (packed ``thd`` and padded ``bshd``, context
  parallelism, ``--allgather-cp`` and its redistribution, all Miles's code),
  but with the temperature passed into the chunks instead of dividing a copy.

``true_on_policy`` mode keeps Miles's own code in both: it must match the
rollout engine bit for bit (a full-vocabulary gather and ``log_softmax`` in
the engine's dtype), which a different, more precise arithmetic would not.
``entropy_requires_grad`` is honoured (the entropy is detached without it).

Use it with Miles's own hook, no source edit::

    --custom-megatron-init-path chunked_entropy.integrations.miles.install

Checked against Miles's code at commit 31f1ca96 (2026-08-21).
"""

from __future__ import annotations

import copy
import sys
from typing import Optional

import torch

from ..logits import log_probs_and_entropy
from ..options import Chunking
from ..parallel import agreed_call
from . import _hidden_route
from ._common import Patch, Target, check_parameters, sharded_over
from ._hidden_route import HiddenStates

__all__ = ["DEFAULT_CHUNK_SIZE", "ROUTES", "HiddenStates", "calculate_log_probs_and_entropy",
           "get_log_probs_and_entropy", "install", "installed", "route", "uninstall"]

#: The chunk size used for Miles's ``--log-probs-chunk-size -1`` ("no chunking").
DEFAULT_CHUNK_SIZE = 512

#: The routes :func:`install` takes (``route=``, or the environment variable ``CHUNKED_ENTROPY_MILES_ROUTE``).
ROUTES = _hidden_route.ROUTES
_ROUTE_ENV = "CHUNKED_ENTROPY_MILES_ROUTE"

_MATH = "miles.backends.training_utils.loss_hub.math_utils"
_PROCESSORS = "miles.backends.training_utils.loss_hub.logit_processors"
#: Modules that hold ``get_log_probs_and_entropy`` by name (besides where it is defined).
GET_HOLDERS = (
    _PROCESSORS,
    "miles.backends.training_utils.loss",
    "miles.backends.training_utils.loss_hub.losses",
    "miles.backends.megatron_utils.actor",
    "miles.backends.fsdp_utils.actor",
)
_CALC_PARAMS = ("logits", "tokens", "tp_group", "with_entropy", "entropy_requires_grad", "chunk_size",
                "true_on_policy", "vocab_size")
_GET_PARAMS = ("logits", "args", "unconcat_tokens", "total_lengths", "response_lengths", "with_entropy",
               "entropy_requires_grad", "non_loss_data", "max_seq_lens")

_WRITTEN_FOR = "Miles (written at commit 31f1ca96)"


def _chunking(size) -> Chunking:
    """Miles's ``chunk_size`` / ``--log-probs-chunk-size`` (-1 or None, "no chunking": :data:`DEFAULT_CHUNK_SIZE`)."""
    return Chunking(DEFAULT_CHUNK_SIZE if size is None or size <= 0 else int(size))


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    chunk_size: int = -1,
    true_on_policy: bool = False,
    vocab_size: Optional[int] = None,
    *,
    temperature: float = 1.0,
):
    """Miles's ``calculate_log_probs_and_entropy`` outside ``true_on_policy`` mode, in one chunked pass.

    Args:
        logits: ``[R, V/tp]`` one response's rows of this rank's vocabulary
            shard (float32 or bf16); never written.
        tokens: ``[R]`` the response's token ids (global).
        tp_group: the tensor-parallel group the vocabulary is sharded over.
        with_entropy: also return the entropy.
        entropy_requires_grad: whether the entropy carries a gradient.
        chunk_size: rows per chunk; ``-1`` (Miles's "no chunking") means
            :data:`DEFAULT_CHUNK_SIZE`.
        true_on_policy: Miles's bit-exact mode: runs Miles's own function.
        vocab_size: used by ``true_on_policy`` only.
        temperature: applied inside the chunks (keyword only; Miles's own
            callers divide the logits before calling and pass none).

    Returns:
        ``(log_prob [R, 1], entropy [R] or None)``, float32, as Miles returns
        them (``[0]`` for no rows).
    """
    if true_on_policy:
        return _PATCH.original("calculate_log_probs_and_entropy")(logits, tokens, tp_group, with_entropy=with_entropy,
                                 entropy_requires_grad=entropy_requires_grad, chunk_size=chunk_size,
                                 true_on_policy=True, vocab_size=vocab_size)
    if logits.size(0) == 0:
        return logits.new_zeros((0,)), (logits.new_zeros((0,)) if with_entropy else None)
    out = log_probs_and_entropy(
        logits, tokens, layer=sharded_over(tp_group), chunking=_chunking(chunk_size), temperature=temperature,
        compute_entropy=bool(with_entropy),
    )
    entropy = out.entropy
    if entropy is not None and not entropy_requires_grad:
        entropy = entropy.detach()
    return out.log_probs.unsqueeze(-1), entropy


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args,
    unconcat_tokens: list,
    total_lengths: list,
    response_lengths: list,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    non_loss_data: bool = True,
    max_seq_lens: Optional[list] = None,
) -> dict:
    """Miles's ``get_log_probs_and_entropy`` with the temperature applied inside the chunks.

    The response rows come from Miles's own ``get_responses`` (run with a
    temperature of 1, so it makes no divided copy); each goes through
    :func:`calculate_log_probs_and_entropy` with ``temperature=``; under
    ``--allgather-cp`` Miles's own ``allgather_cp_redistribute`` follows.
    ``true_on_policy`` mode runs Miles's own function. Arguments and results
    are Miles's.

    On the hidden-state route ``logits`` is the :class:`HiddenStates` the
    patched post-processing returned: Miles's own ``get_responses`` slices a
    ``[B, S, 1]`` tensor of row numbers (its packed ``thd`` or padded
    ``bshd`` layout, context parallelism, all Miles's code), and only those
    rows go through the fused head (``rows=``): no ``[T, V/tp]`` tensor; the
    ``M`` response rows' hidden states are gathered once (``[M, H]``, kept for
    backward), the head's chunk buffers come and go, backward allocates
    ``[T, H]`` and the weight's gradient.
    """
    if isinstance(logits, HiddenStates):
        return _from_hidden(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                            entropy_requires_grad, max_seq_lens)
    if getattr(args, "true_on_policy_mode", False):
        return _PATCH.original("get_log_probs_and_entropy")(
            logits, args=args, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths,
            response_lengths=response_lengths, with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad, non_loss_data=non_loss_data, max_seq_lens=max_seq_lens,
        )
    assert non_loss_data
    miles = sys.modules[_PROCESSORS]  # Miles's own slicing and parallel state, looked up at call time
    t = float(args.rollout_temperature)
    temperature = t if logits.size(-1) > 1 and t > 0 else 1.0  # when Miles's get_responses would divide
    untempered = copy.copy(args)
    untempered.rollout_temperature = 1.0
    tp_group = miles.get_parallel_state().tp.group
    log_probs, entropies = [], []
    for logits_chunk, tokens_chunk in miles.get_responses(
        logits, args=untempered, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths,
        response_lengths=response_lengths, max_seq_lens=max_seq_lens,
    ):
        log_prob, entropy = calculate_log_probs_and_entropy(
            logits_chunk, tokens_chunk, tp_group, with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad, chunk_size=args.log_probs_chunk_size,
            temperature=temperature,
        )
        log_probs.append(log_prob.squeeze(-1))
        if with_entropy:
            entropies.append(entropy)
    res = {"log_probs": log_probs}
    if with_entropy:
        res["entropy"] = entropies
    if args.allgather_cp:
        miles.allgather_cp_redistribute(res, logits=logits, args=args, total_lengths=total_lengths,
                                        response_lengths=response_lengths, max_seq_lens=max_seq_lens)
    return res


def _from_hidden(states: HiddenStates, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                 entropy_requires_grad, max_seq_lens) -> dict:
    """The hidden-state route: the response rows Miles's ``get_responses`` picks, through the fused head."""
    miles = sys.modules[_PROCESSORS]
    head = states.head(_chunking(args.log_probs_chunk_size))
    hidden = states.hidden
    with agreed_call(head.layer.process_group) as call:
        if hidden.dim() != 3:
            raise ValueError(f"Miles's hidden states must be [S, B, H], got {tuple(hidden.shape)}")
        s = hidden.shape[0] * (call.world if head.layer.sequence_parallel else 1)
        b = hidden.shape[1]
        # row numbers in the hidden states' [S, B] order, laid out as Miles's logits [B, S, 1]
        # (float32 is exact up to 2**24 rows; Miles's get_responses accepts float32)
        if s * b > 2 ** 24:
            raise ValueError(f"the hidden-state route numbers rows in float32: at most 2**24, got {s * b}")
        numbers = torch.arange(s * b, device=hidden.device, dtype=torch.float32).view(s, b)
        numbers = numbers.t().contiguous().unsqueeze(-1)
        untempered = copy.copy(args)
        untempered.rollout_temperature = 1.0
        picked = list(miles.get_responses(numbers, args=untempered, unconcat_tokens=unconcat_tokens,
                                          total_lengths=total_lengths, response_lengths=response_lengths,
                                          max_seq_lens=max_seq_lens))
        empty = torch.zeros(0, dtype=torch.int64, device=hidden.device)
        rows = torch.cat([empty] + [r.reshape(-1).to(torch.int64) for r, _ in picked])
        labels = torch.cat([empty] + [t.reshape(-1).to(device=hidden.device, dtype=torch.int64) for _, t in picked])
        lengths = [int(t.numel()) for _, t in picked]
        t = float(args.rollout_temperature)
        temperature = t if t > 0 else 1.0
    out = head(hidden, labels, temperature=temperature, compute_entropy=bool(with_entropy), rows=rows)
    res = {"log_probs": list(out.log_probs.split(lengths))}
    if with_entropy:
        entropy = out.entropy if entropy_requires_grad else out.entropy.detach()
        res["entropy"] = list(entropy.split(lengths))
    if args.allgather_cp:
        miles.allgather_cp_redistribute(res, logits=numbers, args=args,
                                        total_lengths=total_lengths, response_lengths=response_lengths,
                                        max_seq_lens=max_seq_lens)
    return res


_HIDDEN = _hidden_route.postprocess_patch("Miles")


_PATCH = Patch(
    "Miles",
    [Target(m, "calculate_log_probs_and_entropy", calculate_log_probs_and_entropy,
            check_parameters(f"{m}.calculate_log_probs_and_entropy", _CALC_PARAMS, _WRITTEN_FOR))
     for m in (_MATH, _PROCESSORS)]
    + [Target(m, "get_log_probs_and_entropy", get_log_probs_and_entropy,
              check_parameters(f"{m}.get_log_probs_and_entropy", _GET_PARAMS, _WRITTEN_FOR)) for m in GET_HOLDERS],
    "Miles's calculate_log_probs_and_entropy and get_log_probs_and_entropy now run chunked outside "
    "true_on_policy mode: no float32 copies, no saved softmax, the temperature inside the chunks",
)


_ADAPTER = _hidden_route.RoutedAdapter(
    _PATCH, _HIDDEN, route_env=_ROUTE_ENV, framework="Miles",
    fallbacks=[(lambda args: getattr(args, "true_on_policy_mode", False),
                "Miles's true_on_policy mode (bit-exact with the rollout engine on the logits)")],
)


def install(args=None, *, route: Optional[str] = None) -> None:
    """Miles's ``--custom-megatron-init-path`` hook: replace both functions wherever Miles looks them up.

    On the hidden-state route (the default; ``route=`` or the environment
    variable ``CHUNKED_ENTROPY_MILES_ROUTE``, one of :data:`ROUTES`) also
    megatron-core's ``GPTModel._postprocess``, so that the actor's forwards
    hand on the hidden states instead of the logits. ``true_on_policy`` mode
    (bit-exact with the rollout engine: Miles's own arithmetic on the logits)
    and a custom loss (which may read the logits) get the logits route, with
    one logged warning. On the hidden-state route, ``--fp8-output-proj``
    (megatron-core >= 0.19's MXFP8 output layer) is a ValueError saying to take
    the logits route (the fused head would compute that layer in bf16).

    Idempotent. Checks every target already imported first; on a mismatch it
    raises RuntimeError and leaves Miles as it was. ``args`` are read per
    call, except ``true_on_policy_mode``, ``loss_type`` and ``fp8_output_proj``.
    """
    _ADAPTER.install(args, route=route)


def uninstall() -> None:
    """Restore Miles's own functions and megatron-core's post-processing (and drop pending hooks)."""
    _ADAPTER.uninstall()


def installed() -> bool:
    """Whether any of the framework's functions is currently replaced."""
    return _ADAPTER.installed()


def route() -> Optional[str]:
    """The route installed: ``"hidden"``, ``"logits"``, or None."""
    return _ADAPTER.route()
