"""The bench's registry: its cases and its methods, each one record of :data:`METHODS`.

A case (:class:`Case`) is one method on one shape; :class:`Inputs` builds its tensors. Each method is one
:class:`Method` record of :data:`METHODS` (plain torch, the clone workaround, this library's logits path, fused
head, losses and divergences, the peers): what it runs (:func:`loss_of`, the scalar a forward+backward is timed
through), how it is labelled, swept and estimated. A new method is one record here.
:mod:`chunked_entropy.cli._measure` measures a case; :mod:`chunked_entropy.cli._process` runs it in a fresh
process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = ("logits", "head")
#: The objective of the loss methods: PPO clip with dual clip and an entropy bonus, token-mean.
LOSS = dict(clip_ratio_c=3.0, entropy_coeff=0.01, loss_agg_mode="token-mean")


@dataclass(frozen=True)
class Method:
    """One method of the bench: what it runs, how it is labelled, swept and estimated (see :data:`METHODS`).

    Attributes:
        name: its ``--methods`` name.
        label: its label in the tables; ``{chunk}`` is the case's chunk size.
        paths: the inputs it takes: ``"logits"`` (a ``[tokens, V/tp]`` leaf) and/or ``"head"`` (hidden states
            and an lm_head weight).
        run: the function of this module whose scalar's forward+backward is timed, ``run(case, inputs, group)``.
        plan: the ``chunked-entropy plan`` method whose estimate its peak is compared with (``plain``,
            ``clone``, ``chunked``, ``head``); None: ``head`` on the head path, ``chunked`` on the logits path.
        swept: measured at every ``--chunk-sizes`` and ``--backends`` (this library's methods and verl's
            chunked routes); the others once, chunk 0, eager.
        default: the paths whose sweep measures it when ``--methods`` is not given.
        matmul: on the head path it first computes the logits with a plain matmul (labelled ``matmul + ``).
        tp: the label's suffix when measured with the vocabulary over ``{tp}`` ranks; empty: one rank only.
        keep: sampling replay: ``"sets"`` (this library's kept sets, at every ``--keep`` value), ``"dense"``
            (slime's dense ``[N, V]`` mask, at the non-zero ones) or empty (no replay).
        topk: distillation: the teacher's top-k when ``--topk`` is not given (the largest given otherwise);
            None: no top-k.
        loss: a policy loss: swept over ``--loss-modes``, laid out by ``--seq-len``.
        read: measured at every ``--read`` (the rows whose label is kept).
        only_read: it projects only the rows read (the others: every row, the rest masked).
        teacher: the inputs include a teacher's hidden states and weight shard.
        floor: its physical floor is timed after it (:func:`floor_seconds`).
        full_vocab: it gathers the full vocabulary on every rank (the plan's shape is one rank's).
        outputs: ``outputs(case, inputs, group) -> (log_probs, entropy)``, for ``run`` to use (the per-token
            scalar, or a loss composed from them); None for the methods whose ``run`` computes its own.
    """

    name: str
    label: str
    paths: tuple
    run: Callable
    plan: Optional[str]
    swept: bool = False
    default: tuple = ()
    matmul: bool = False
    tp: str = ""
    keep: str = ""
    topk: Optional[int] = None
    loss: bool = False
    read: bool = False
    only_read: bool = False
    teacher: bool = False
    floor: bool = False
    full_vocab: bool = False
    outputs: Optional[Callable] = None  # (log_probs, entropy) of the per-token and composed-loss methods


def methods(path: Optional[str] = None) -> tuple:
    """The names of the methods (that take ``path``'s inputs), in the table's order."""
    return tuple(m.name for m in METHODS.values() if path is None or path in m.paths)


@dataclass(frozen=True)
class Case:
    """One measurement: a method on a shape.

    ``path`` is what the inputs are: ``"logits"`` (a ``[tokens, V/tp]`` leaf
    tensor) or ``"head"`` (hidden ``[tokens, hidden]`` and a weight
    ``[V/tp, hidden]``). ``method`` names its record in :data:`METHODS`
    (:attr:`spec`). ``chunk`` is the chunk size of the swept methods (0 for
    the others).
    """

    path: str
    method: str
    tokens: int
    vocab: int
    hidden: int = 0
    chunk: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    tp: int = 1
    seed: int = 0
    backend: str = "eager"
    warm: bool = False
    keep: int = 0  # sampling replay: kept ids per token (0: none)
    loss_mode: str = "vanilla"  # the policy objective of the loss methods (chunked_entropy.losses.LOSS_MODES)
    topk: int = 0  # distillation: the teacher's top-k per token (the distill methods)
    seq_len: int = 0  # the loss methods' [B, T] layout: tokens per sequence (0: one sequence of them all)
    read: int = 0  # percent of the rows whose label is read (the rest -100, as prompts are); 0: every row
    allocations: bool = False  # also report alloc_peak_bytes (CPU: a second, logged forward+backward)

    @property
    def spec(self) -> Method:
        """The case's :class:`Method` record."""
        m = METHODS.get(self.method)
        if m is None or self.path not in m.paths:
            raise ValueError(f"unknown method {self.method!r}; expected one of {methods(self.path)}")
        return m

    @property
    def label(self) -> str:
        m = self.spec
        name = m.label.format(chunk=self.chunk)
        if self.read:
            name += f", {self.read}% of rows read"
        if self.path == "head" and m.matmul:
            name = "matmul + " + name
        if self.keep:
            name += f", keep {self.keep}/token"
        if self.topk:
            name += f", teacher top-{self.topk}"
        if m.loss and self.loss_mode != "vanilla":
            name += f", {self.loss_mode}"
        if m.loss and self.seq_len:
            name += f", {self.tokens // self.seq_len} x {self.seq_len}"
        if self.tp > 1:
            name += m.tp.format(tp=self.tp)
        if self.backend != "eager":
            name += f" [{self.backend}]"
        return name

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "Case":
        return Case(**json.loads(text))


class Inputs:
    """Deterministic inputs of a case, for this rank's vocabulary shard."""

    def __init__(self, case: Case, rank: int = 0, world: int = 1):
        dev = torch.device(case.device)
        dt = DTYPES[case.dtype]
        n, v = case.tokens, case.vocab
        if v % world:
            raise ValueError(f"vocab {v} must be divisible by tp {world}")
        vl = v // world
        lo = rank * vl
        g = torch.Generator(device=dev).manual_seed(case.seed)
        self.labels = torch.randint(0, v, (n,), generator=g, device=dev)
        self.g_lp = torch.randn(n, generator=g, device=dev)
        self.g_h = torch.randn(n, generator=g, device=dev)
        if case.read:  # in every block of 128 rows, the last read% are labelled (a response after its prompt; short
            # blocks, so that the warm-up's one chunk of tokens reads some)
            read = torch.arange(n, device=dev) % 128 >= 128 - 128 * case.read // 100
            self.labels[~read] = -100
            self.g_h *= read  # the entropy of a row that is not read is not used either
        # rollout data of the policy-loss methods: [B, T], B sequences of case.seq_len tokens (or one)
        if case.seq_len and n % case.seq_len:
            raise ValueError(f"seq_len {case.seq_len} must divide tokens {n}")
        self.rows = (n // case.seq_len, case.seq_len) if case.seq_len else (1, n)
        self.old = (-torch.rand(self.rows, generator=g, device=dev) * 4 - 6)
        self.adv = torch.randn(self.rows, generator=g, device=dev)
        self.mask = torch.rand(self.rows, generator=g, device=dev) > 0.1
        # sampling replay: case.keep kept ids per token, global, in vLLM's CSR layout (the same on every rank)
        self.keep = None
        if case.keep:
            ids = torch.randint(0, v, (n * case.keep,), generator=g, device=dev)
            self.keep = (ids, torch.arange(0, n * case.keep + 1, case.keep, device=dev))
        # distillation: the teacher's top-k ids and log-probs per token (global ids, the same on every rank)
        self.teacher_ids = self.teacher_lp = None
        if case.topk:
            self.teacher_ids = torch.randint(0, v, (n, case.topk), generator=g, device=dev)
            self.teacher_lp = torch.log_softmax(torch.randn(n, case.topk, generator=g, device=dev) * 2, -1) - 0.5
        self.logits = self.hidden = self.weight = None
        if case.path == "logits":
            full = torch.randn(n, v, generator=g, device=dev).mul_(2.0)
            shard = full if world == 1 else full[:, lo : lo + vl].clone()
            del full
            self.logits = shard.to(dt).requires_grad_(True)
        else:
            h = case.hidden
            self.hidden = torch.randn(n, h, generator=g, device=dev).to(dt).requires_grad_(True)
            w = torch.randn(v, h, generator=g, device=dev).mul_(2.0 / h**0.5)
            shard = w if world == 1 else w[lo : lo + vl].clone()
            del w
            self.weight = shard.to(dt).requires_grad_(True)
            if case.spec.teacher:  # the teacher: its hidden states and weight shard, no gradient
                self.teacher_hidden = torch.randn(n, h, generator=g, device=dev).to(dt)
                tw = torch.randn(v, h, generator=g, device=dev).mul_(2.5 / h**0.5)
                self.teacher_weight = (tw if world == 1 else tw[lo : lo + vl].clone()).to(dt)
                del tw

    def clear_grads(self):
        for t in (self.logits, self.hidden, self.weight):
            if t is not None:
                t.grad = None


def _chunking(case: Case):
    """This library's chunking of the case: its chunk size and backend."""
    from chunked_entropy import Chunking

    return Chunking(case.chunk, backend=case.backend)


def _layer(inp: Inputs, group):
    """This library's output layer of the case: the weight shard (head path), the group."""
    from chunked_entropy import OutputLayer

    return OutputLayer(inp.weight, process_group=group)


def _logits_layer(group):
    from chunked_entropy import OutputLayer

    return None if group is None else OutputLayer(process_group=group)


def _one_rank(case: Case, group, what: str) -> None:
    if group is not None:
        raise ValueError(f"{what} has no vocabulary parallelism; use tp=1")


# ----------------------------------------------------------------------------- log-probs and entropy, per method


def _head_outputs(case: Case, inp: Inputs, group):
    """The fused head (``headrows``: only the rows read, ``rows="kept"``; ``headlp``, ``headrowslp``: the same,
    log-probs only)."""
    from chunked_entropy import linear_log_probs_and_entropy

    entropy = case.method not in ("headlp", "headrowslp")
    rows = "kept" if case.method in ("headrows", "headrowslp") else None
    out = linear_log_probs_and_entropy(inp.hidden, _layer(inp, group), inp.labels, chunking=_chunking(case),
                                       keep=inp.keep, rows=rows, compute_entropy=entropy)
    return out if entropy else (out.log_probs, None)


def _all_rows_log_probs(case: Case, inp: Inputs, group):
    """Log-probs only, every row (rows not read are labelled -100: zero, no gradient): torch's own
    ``F.linear_cross_entropy(reduction="none")`` (its chunked options), or plain torch (a matmul and
    ``F.cross_entropy``)."""
    import torch.nn.functional as F

    _one_rank(case, group, case.method)
    if case.method == "torchlceall":
        return -F.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, reduction="none",
                                       options=torch.nn.LinearCrossEntropyOptions()), None
    return -F.cross_entropy(inp.hidden @ inp.weight.t(), inp.labels, reduction="none"), None


def _compacted_outputs(case: Case, inp: Inputs, group):
    """TRL's kernel or torch's ``F.linear_cross_entropy`` on ``hidden[mask]``: the compaction these peers leave
    to their caller."""
    _one_rank(case, group, case.method)
    mask = inp.labels != -100
    hidden, labels = inp.hidden[mask], inp.labels[mask]
    if case.method == "trlrows":
        import trl.trainer.utils as trl_utils

        lp, ent, *_ = trl_utils._ChunkedLogProbFunction.apply(
            hidden, inp.weight, None, labels, 1.0, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",))
    else:
        import torch.nn.functional as F

        lp = -F.linear_cross_entropy(hidden, inp.weight, labels, reduction="none",
                                     options=torch.nn.LinearCrossEntropyOptions())
        ent = None
    back = lambda x: None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)  # noqa: E731
    return back(lp), back(ent)


def _logits(case: Case, inp: Inputs):
    """The logits: the input (logits path), or a plain matmul of the hidden states (head path)."""
    return inp.logits if case.path == "logits" else inp.hidden @ inp.weight.t()


def _plain_outputs(case: Case, inp: Inputs, group):
    from . import baselines

    _one_rank(case, group, "plain torch")
    return baselines.plain_log_probs_and_entropy(_logits(case, inp), inp.labels)


def _clone_outputs(case: Case, inp: Inputs, group):
    from . import baselines

    return baselines.clone_workaround(_logits(case, inp), inp.labels, group)


def _dense_keep_outputs(case: Case, inp: Inputs, group):
    from . import baselines

    _one_rank(case, group, "the dense-mask route")
    return baselines.dense_keep_log_probs_and_entropy(_logits(case, inp), inp.labels, *inp.keep)


def _chunked_outputs(case: Case, inp: Inputs, group):
    from chunked_entropy import log_probs_and_entropy

    return log_probs_and_entropy(_logits(case, inp), inp.labels, layer=_logits_layer(group), chunking=_chunking(case),
                                 keep=inp.keep)


def outputs(case: Case, inp: Inputs, group):
    """``(log_probs, entropy)`` of the case's method (the forward pass)."""
    return case.spec.outputs(case, inp, group)


# ----------------------------------------------------------------------------- the scalar each method times


def per_token(case: Case, inp: Inputs, group):
    """``sum(g_lp * log_prob + g_h * entropy)`` over the method's outputs (random upstream gradients)."""
    lp, ent = outputs(case, inp, group)
    return (lp * inp.g_lp).sum() + (0 if ent is None else (ent * inp.g_h).sum())


def composed_policy_loss(case: Case, inp: Inputs, group):
    """The policy loss composed from the method's outputs and :mod:`chunked_entropy.losses`."""
    from chunked_entropy import PolicyLoss, losses

    lp, ent = outputs(case, inp, group)
    o = LOSS
    pg, _ = losses.policy_loss(lp.view(inp.rows), inp.old, inp.adv, inp.mask, PolicyLoss(
        case.loss_mode, options={"clip_ratio_c": o["clip_ratio_c"]}, aggregation=o["loss_agg_mode"]))
    return pg - o["entropy_coeff"] * losses.entropy_bonus(ent.view(inp.rows), inp.mask, o["loss_agg_mode"])


def fused_policy_loss(case: Case, inp: Inputs, group):
    """The fused policy loss: over the hidden states (head path) or the logits."""
    from chunked_entropy import PolicyLoss, linear_policy_loss, policy_loss_from_logits

    o = LOSS
    loss = PolicyLoss(case.loss_mode, {"clip_ratio_c": o["clip_ratio_c"]}, entropy_coeff=o["entropy_coeff"],
                      aggregation=o["loss_agg_mode"])
    labels = inp.labels.view(inp.rows)
    if case.path == "head":
        return linear_policy_loss(inp.hidden.view(*inp.rows, -1), _layer(inp, group), labels, inp.old, inp.adv,
                                  inp.mask, loss=loss, chunking=_chunking(case))[0]
    return policy_loss_from_logits(inp.logits.view(*inp.rows, -1), labels, inp.old, inp.adv, inp.mask, loss=loss,
                                   layer=_logits_layer(group), chunking=_chunking(case))[0]


def distillation_loss(case: Case, inp: Inputs, group):
    """Log-probs, entropy and the teacher's top-k forward KL (with verl's diagnostics) in one scalar."""
    from chunked_entropy import log_probs_and_entropy, losses

    out = log_probs_and_entropy(inp.logits, inp.labels, layer=_logits_layer(group), chunking=_chunking(case),
                                log_probs_at=inp.teacher_ids, top_k=case.topk)
    kl = losses.topk_forward_kl(out.log_probs_at, inp.teacher_lp, log_prob_min_clamp=-10.0)
    losses.topk_overlap(inp.teacher_ids, out.top_k_ids, kl.per_id)
    return (out.log_probs * inp.g_lp).sum() + (out.entropy * inp.g_h).sum() + kl.kl.sum()


def verl_distillation_loss(case: Case, inp: Inputs, group):
    """The same with plain torch's log-probs and entropy and verl's ``forward_kl_topk`` (a full log-softmax)."""
    _one_rank(case, group, "verl's FSDP distillation route")
    import contextlib
    from types import SimpleNamespace

    from . import baselines

    with contextlib.redirect_stdout(sys.stderr):  # the case's stdout is the bench's protocol; verl prints
        from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk
        from verl.workers.config.distillation import DistillationLossConfig

        config = SimpleNamespace(distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", log_prob_min_clamp=-10.0, use_policy_gradient=False))
    lp, ent = baselines.plain_log_probs_and_entropy(inp.logits, inp.labels)
    nested = lambda t: torch.nested.nested_tensor([t], layout=torch.jagged)  # noqa: E731
    out = compute_forward_kl_topk(inp.logits.unsqueeze(0), nested(inp.teacher_lp), nested(inp.teacher_ids), config,
                                  "thd")
    return (lp * inp.g_lp).sum() + (ent * inp.g_h).sum() + out["distillation_losses"].sum()


def verl_fsdp_loss(case: Case, inp: Inputs, group):
    """verl's FSDP engine on one packed sequence (temperature 1, entropy on, top-k distillation with ``topk``):
    the unfused route through the engine's real ``prepare_model_outputs`` on ``hidden @ weight.T``, or the fused
    route through verl's real ``FusedLinearForPPO``; verl's own code, or with the plugin installed.

    With a process group (``tp > 1``, the unfused routes): the logits ``hidden @ weight_shard.T`` of each rank,
    as one vocabulary-sharded DTensor (``Shard(-1)`` on a 1-D mesh of the group), as a ``ColwiseParallel`` lm_head
    returns them: verl's own gathers the full vocabulary on every rank (``full_tensor()``), the plugin reads the
    local shard with the mesh's group."""
    if group is not None and not case.spec.tp:
        raise ValueError("verl's fused FSDP routes are measured on one rank; use tp=1")
    import contextlib
    import functools
    import logging
    import warnings
    from types import SimpleNamespace

    plugged = case.method in ("fsdpplugin", "fusedplugin")
    # the plugin installed as users install it: verl imports it in its own `import verl` (each case is a process)
    if plugged:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = "chunked_entropy.integrations.verl_plugin"
    else:
        os.environ.pop("VERL_USE_EXTERNAL_MODULES", None)
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():  # stdout is the bench's protocol
        warnings.simplefilter("ignore")
        import verl.utils.torch_functional as verl_F
        from verl.utils import tensordict_utils as tu
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
        from verl.workers.config import FSDPEngineConfig
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    routes = (FSDPEngineWithLMHead.prepare_model_outputs, FusedLinearForPPO.forward)
    if any(f.__module__.startswith("chunked_entropy") != plugged for f in routes):
        raise RuntimeError(f"verl's FSDP routes are {'not ' if plugged else ''}the plugin's in this process")
    if case.method in ("verlfused", "fusedplugin"):
        if case.topk:
            raise ValueError("verl's fused route has no top-k distillation outside verl's engine; use topk 0")
        lp, ent = FusedLinearForPPO(chunk_size=case.chunk).forward(inp.hidden, inp.weight, inp.labels, 1.0)
        return (lp * inp.g_lp).sum() + (ent * inp.g_h).sum()
    n = case.tokens
    engine = object.__new__(FSDPEngineWithLMHead)  # what prepare_model_outputs reads of an initialised engine
    engine.engine_config = FSDPEngineConfig(entropy_from_logits_chunk_size=case.chunk, use_torch_compile=False)
    engine.compute_entropy_from_logits, engine.use_ulysses_sp = verl_F.entropy_from_logits, False
    nested = lambda t: torch.nested.nested_tensor_from_jagged(t, torch.tensor([0, n], device=t.device))  # noqa: E731
    tensors = {"input_ids": nested(inp.labels)}
    loss_fn = None
    if case.topk:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from verl.trainer.distillation import distillation_ppo_loss
            from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

            actor = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                                    rollout_n=1, use_dynamic_bsz=False)
            dcfg = DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(
                loss_mode="forward_kl_topk", topk=case.topk, log_prob_min_clamp=-10.0, use_policy_gradient=False))
        loss_fn = functools.partial(distillation_ppo_loss, config=actor, distillation_config=dcfg)
        tensors.update(teacher_ids=nested(inp.teacher_ids), teacher_logprobs=nested(inp.teacher_lp))
    batch = tu.get_tensordict(tensors, non_tensor_dict=dict(
        temperature=1.0, calculate_entropy=True, use_remove_padding=True, distillation_use_topk=bool(case.topk)))
    output_args = {"temperature_is_one": True, "input_ids_rmpad_rolled": inp.labels, "pad_size": 0,
                   "temperature_rmpad": torch.ones(n, device=inp.labels.device)}
    logits = (inp.hidden @ inp.weight.t()).unsqueeze(0)
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = DeviceMesh.from_group(group, logits.device.type)
        logits = DTensor.from_local(logits, mesh, [Shard(-1)], run_check=False)
    # what the plugin cannot serve runs verl's own with a logged warning: here that would measure the wrong route
    fallbacks, handler = [], logging.Handler(logging.WARNING)
    handler.emit = lambda record: fallbacks.append(record.getMessage())
    log = logging.getLogger("chunked_entropy.integrations")
    log.addHandler(handler)
    try:
        out = engine.prepare_model_outputs(SimpleNamespace(logits=logits), output_args, batch, loss_fn)
    finally:
        log.removeHandler(handler)
    if plugged and fallbacks:
        raise RuntimeError(f"the plugin ran verl's own route here: {fallbacks[0]}")
    loss = (out["log_probs"].values() * inp.g_lp).sum() + (out["entropy"].values() * inp.g_h).sum()
    return loss + out["distillation_losses"].values().sum() if case.topk else loss


def divergence(case: Case, inp: Inputs, group):
    """The reverse KL between the student's and the teacher's distributions, per token: ``sum(g * D)``."""
    from chunked_entropy import OutputLayer, linear_divergence

    d = linear_divergence(inp.hidden, _layer(inp, group), inp.teacher_hidden,
                          OutputLayer(inp.teacher_weight, process_group=group), divergence="reverse_kl",
                          chunking=case.chunk)
    return (d.divergence * inp.g_lp).sum()


def divergence_mean(case: Case, inp: Inputs, group):
    """The loss form: the mean of the reverse KL, gradients formed in forward."""
    from chunked_entropy import OutputLayer, linear_divergence_loss

    return linear_divergence_loss(inp.hidden, _layer(inp, group), inp.teacher_hidden,
                                  OutputLayer(inp.teacher_weight, process_group=group), divergence="reverse_kl",
                                  chunking=case.chunk).loss


def trl_divergence(case: Case, inp: Inputs, group):
    """TRL 1.16's ChunkedDivergenceFunction at its beta 1 (the reverse KL)."""
    _one_rank(case, group, case.method)
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    d, _ = ChunkedDivergenceFunction.apply(inp.hidden, inp.weight, None, inp.teacher_hidden, inp.teacher_weight,
                                           None, 1.0)
    return (d * inp.g_lp).sum()


def plain_divergence(case: Case, inp: Inputs, group):
    """Plain torch: two matmuls, two log-softmaxes, the reverse KL."""
    _one_rank(case, group, case.method)
    lps = torch.log_softmax((inp.hidden @ inp.weight.t()).float(), dim=-1)
    with torch.no_grad():
        lpt = torch.log_softmax((inp.teacher_hidden @ inp.teacher_weight.t()).float(), dim=-1)
    return ((lps.exp() * (lps - lpt)).sum(-1) * inp.g_lp).sum()


def liger_loss(case: Case, inp: Inputs, group):
    """Liger's fused linear cross entropy, when installed (log-probs only)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        raise RuntimeError("liger-kernel is not installed") from None
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(inp.weight, inp.hidden, inp.labels)


def loss_of(case: Case, inp: Inputs, group):
    """The scalar whose backward we time (the method's ``run``)."""
    return case.spec.run(case, inp, group)


_ON = ("logits", "head")
_HEAD = ("head",)
_TP = ", TP {tp}"
#: Every method of the bench, one record each, in the order of ``--methods``' help.
METHODS = {m.name: m for m in (
    Method("plain", "plain torch", _ON, per_token, "plain", default=_ON, matmul=True, outputs=_plain_outputs),
    Method("clone", "clone workaround", _ON, per_token, "clone", default=_ON, matmul=True, tp=_TP,
           outputs=_clone_outputs),
    Method("chunked", "chunked, chunk {chunk}", _ON, per_token, "chunked", swept=True, default=_ON, matmul=True,
           tp=_TP, keep="sets", floor=True, outputs=_chunked_outputs),
    Method("chunkedloss", "chunked + losses, chunk {chunk}", ("logits",), composed_policy_loss, "chunked",
           swept=True, loss=True, outputs=_chunked_outputs),
    Method("head", "fused head, chunk {chunk}", _HEAD, per_token, "head", swept=True, default=_HEAD, tp=_TP,
           keep="sets", read=True, floor=True, outputs=_head_outputs),
    Method("headloss", "fused head + losses, chunk {chunk}", _HEAD, composed_policy_loss, "head", swept=True,
           loss=True, outputs=_head_outputs),
    Method("fusedloss", "fused policy loss, chunk {chunk}", _ON, fused_policy_loss, None, swept=True, loss=True,
           floor=True),
    Method("liger", "Liger fused linear cross entropy (log-probs only)", _HEAD, liger_loss, "head"),
    Method("densekeep", "dense keep mask + masked_fill copy + plain torch", _ON, per_token, "plain", matmul=True,
           keep="dense", outputs=_dense_keep_outputs),
    Method("distill", "chunked + log_probs_at + top_k, chunk {chunk}", ("logits",), distillation_loss, "chunked",
           swept=True, topk=128, floor=True),
    Method("verldistill", "plain torch + verl's forward_kl_topk (FSDP route: full log-softmax)", ("logits",),
           verl_distillation_loss, "plain", topk=128),
    Method("verlfsdp", "matmul + verl FSDP engine's prepare_model_outputs (verl's own)", _HEAD, verl_fsdp_loss,
           "plain", swept=True, tp=", logits a vocabulary-sharded DTensor over {tp} ranks", topk=0,
           full_vocab=True),
    Method("fsdpplugin", "matmul + verl FSDP engine's prepare_model_outputs (plugin), chunk {chunk}", _HEAD,
           verl_fsdp_loss, "chunked", swept=True, tp=", logits a vocabulary-sharded DTensor over {tp} ranks",
           topk=0),
    Method("verlfused", "verl's FusedLinearForPPO, torch backend (verl's own), chunk {chunk}", _HEAD,
           verl_fsdp_loss, "head", swept=True),
    Method("fusedplugin", "verl's FusedLinearForPPO (plugin), chunk {chunk}", _HEAD, verl_fsdp_loss, "head",
           swept=True),
    Method("divergence", "linear_divergence (reverse KL, per token), chunk {chunk}", _HEAD, divergence, "head",
           swept=True, teacher=True),
    Method("divergenceloss", "linear_divergence_loss (reverse KL, mean), chunk {chunk}", _HEAD, divergence_mean,
           "head", swept=True, teacher=True),
    Method("trldivergence", "TRL 1.16 ChunkedDivergenceFunction (beta 1; torch tiles off Triton)", _HEAD,
           trl_divergence, "plain", teacher=True),
    Method("plaindivergence", "plain torch: two matmuls, two log_softmax, reverse KL", _HEAD, plain_divergence,
           "plain", teacher=True),
    Method("headrows", "fused head, rows='kept', chunk {chunk}", _HEAD, per_token, "head", swept=True, read=True,
           only_read=True, outputs=_head_outputs),
    Method("trlrows", "TRL 1.16 compacted: hidden[mask] into ChunkedLogProbFunction", _HEAD, per_token, "head",
           read=True, only_read=True, outputs=_compacted_outputs),
    Method("torchlce", "torch F.linear_cross_entropy (chunked options) on hidden[mask], log-probs only", _HEAD,
           per_token, "head", read=True, only_read=True, outputs=_compacted_outputs),
    # log-probs only (no entropy): the fused head on all rows and on the rows read, torch's own
    # F.linear_cross_entropy and plain torch on all rows (issue 35's measurement)
    Method("headlp", "fused head, log-probs only, chunk {chunk}", _HEAD, per_token, "head", swept=True, read=True,
           outputs=_head_outputs),
    Method("headrowslp", "fused head, rows='kept', log-probs only, chunk {chunk}", _HEAD, per_token, "head",
           swept=True, read=True, only_read=True, outputs=_head_outputs),
    Method("torchlceall", "torch F.linear_cross_entropy (chunked options), all rows, log-probs only", _HEAD,
           per_token, "head", read=True, outputs=_all_rows_log_probs),
    Method("plainlp", "plain torch, F.cross_entropy on all rows, log-probs only", _HEAD, per_token, "plain",
           read=True, outputs=_all_rows_log_probs),
)}
