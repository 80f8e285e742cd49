"""A small GRPO update loop with a tensor-parallel (vocab-parallel) lm_head, on CPU.

Run it with two tensor-parallel ranks on gloo::

    torchrun --nproc-per-node 2 examples/grpo_tp.py --steps 4

or as a single process (TP=1)::

    python examples/grpo_tp.py --steps 4

The model is a tiny causal LM in plain torch: a token embedding, a couple of
pre-norm transformer blocks (replicated on every rank) and an lm_head whose
weight rows are sharded over the TP group, Megatron style (rank ``r`` holds
vocabulary ids ``[r * V / P, (r + 1) * V / P)``). The head is a
:class:`chunked_entropy.ChunkedVocabParallelHead`: per-token log-probs and
entropy come straight from the hidden states, chunk by chunk, and the
``[tokens, vocab]`` logits never exist. ``fused=False`` instead gathers the
full logits over the group and takes a float64 ``log_softmax`` (the reference
the tests compare against).

Each iteration samples ``group_size`` responses per prompt with the current
policy, scores them with a toy verifiable reward (the share of even token ids
in the response, up to the first EOS), turns the rewards into group-relative
advantages, and takes ``ppo_epochs`` optimizer steps on that rollout with::

    loss = policy_loss(...)                      # PPO clip + dual clip
           - entropy_coeff * entropy_bonus(...)  # entropy bonus on
           + kl_coef * agg_loss(kl_penalty(..., "low_var_kl"))

Rank 0 prints one line per optimizer step.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from chunked_entropy import ChunkedVocabParallelHead, Chunking, OutputLayer, PolicyLoss
from chunked_entropy.losses import agg_loss, entropy_bonus, kl_penalty, policy_loss


@dataclass
class GRPOConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_prompts: int = 4
    group_size: int = 4
    prompt_len: int = 4
    response_len: int = 8
    eos_id: int = 1
    temperature: float = 1.0
    lr: float = 1.0  # plain SGD
    ppo_epochs: int = 2  # optimizer steps per rollout
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 3.0
    entropy_coeff: float = 0.01
    kl_coef: float = 0.001
    kl_kind: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    chunk_size: int = 16
    vocab_chunk_size: Optional[int] = None
    seed: int = 0


# ------------------------------------------------------------------ model


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary shards along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return g.chunk(world, dim=-1)[rank].contiguous(), None


def _tp(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """Embedding + blocks (replicated) + a vocab-parallel lm_head (rows sharded over ``tp_group``).

    Every rank builds the same full model from ``cfg.seed`` and keeps its own
    rows of the head, so TP=1 and TP=2 start from the same weights.
    """

    def __init__(self, cfg: GRPOConfig, tp_group=None):
        super().__init__()
        rank, world = _tp(tp_group)
        if cfg.vocab_size % world:
            raise ValueError(f"vocab_size ({cfg.vocab_size}) must be divisible by the TP size ({world})")
        self.cfg, self.tp_group = cfg, tp_group
        with torch.random.fork_rng():  # a seeded init that leaves the caller's RNG alone
            torch.manual_seed(cfg.seed)
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.blocks = nn.ModuleList(Block(cfg.hidden_size, cfg.num_heads) for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(cfg.hidden_size)
            full = torch.randn(cfg.vocab_size, cfg.hidden_size) / math.sqrt(cfg.hidden_size)
        v_local = cfg.vocab_size // world
        shard = nn.Parameter(full[rank * v_local:(rank + 1) * v_local].clone())
        self.lm_head = ChunkedVocabParallelHead(
            OutputLayer(shard, process_group=tp_group), Chunking(cfg.chunk_size, cfg.vocab_chunk_size)
        )

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` token ids -> ``[B, S, H]`` final hidden states (replicated over the group)."""
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unfused: ``[..., H]`` -> gathered ``[..., V]`` logits (ColumnParallelLinear with gather_output)."""
        if self.tp_group is None:
            return hidden @ self.lm_head.weight.t()
        local = _CopyToTP.apply(hidden, self.tp_group) @ self.lm_head.weight.t()
        return _GatherVocab.apply(local, self.tp_group)

    def log_probs_entropy(self, hidden, labels, mask, *, fused: bool):
        """Log-probs of ``labels`` (0 where ``mask`` is False) and entropy, both ``[B, R]``.

        Fused: :class:`~chunked_entropy.ChunkedVocabParallelHead`, float32.
        Unfused: full logits, float64 ``log_softmax`` (the reference).
        """
        t = self.cfg.temperature
        if fused:
            out = self.lm_head(hidden, labels, temperature=t, label_mask=mask)
            return out.log_probs, out.entropy
        logp = torch.log_softmax(self.full_logits(hidden).double() / t, dim=-1)
        lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        return torch.where(mask, lp, torch.zeros_like(lp)), ent


# ------------------------------------------------------------------ rollout


@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, P + R] prompt and response ids
    mask: torch.Tensor  # [B, R] bool: response tokens up to and including the first EOS
    old_log_probs: torch.Tensor  # [B, R] under the policy that sampled them
    ref_log_probs: torch.Tensor  # [B, R] under the frozen reference policy
    advantages: torch.Tensor  # [B, R] group-relative, broadcast over the response
    rewards: torch.Tensor  # [B]


def response_view(model: TinyCausalLM, tokens: torch.Tensor):
    """Hidden states that predict the response tokens, and those tokens: ``[B, R, H]``, ``[B, R]``."""
    p = model.cfg.prompt_len
    return model.hidden(tokens)[:, p - 1:-1], tokens[:, p:]


@torch.no_grad()
def sample(model: TinyCausalLM, prompts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sample ``response_len`` tokens after ``prompts`` (same generator state on every TP rank)."""
    tokens = prompts
    for _ in range(model.cfg.response_len):
        logits = model.full_logits(model.hidden(tokens)[:, -1])  # [B, V]: tiny, gathered once per token
        probs = torch.softmax(logits.double() / model.cfg.temperature, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return tokens


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True up to and including the first EOS."""
    is_eos = (responses == eos_id).long()
    return (is_eos.cumsum(1) - is_eos) == 0


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``, per prompt group of ``group_size`` (``[B]``)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


@torch.no_grad()
def rollout(model: TinyCausalLM, ref_model: TinyCausalLM, prompts: torch.Tensor, gen: torch.Generator) -> Rollout:
    cfg = model.cfg
    tokens = sample(model, prompts.repeat_interleave(cfg.group_size, 0), gen)
    responses = tokens[:, cfg.prompt_len:]
    mask = response_mask(responses, cfg.eos_id)
    rewards = ((responses % 2 == 0) & mask).sum(1) / mask.sum(1)
    adv = group_advantages(rewards.float(), cfg.group_size)
    old, _ = model.log_probs_entropy(*response_view(model, tokens), mask, fused=True)
    ref, _ = ref_model.log_probs_entropy(*response_view(ref_model, tokens), mask, fused=True)
    return Rollout(tokens, mask, old, ref, adv[:, None].expand_as(old).contiguous(), rewards)


# ------------------------------------------------------------------ loss and step


def grpo_loss(model: TinyCausalLM, batch: Rollout, *, fused: bool = True):
    """The actor loss on a rollout and its metrics (mean entropy, clip fractions, KL)."""
    cfg = model.cfg
    hidden, labels = response_view(model, batch.tokens)
    lp, ent = model.log_probs_entropy(hidden, labels, batch.mask, fused=fused)
    pg, metrics = policy_loss(
        lp, batch.old_log_probs, batch.advantages, batch.mask,
        PolicyLoss(options={"clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high,
                            "clip_ratio_c": cfg.clip_ratio_c}, aggregation=cfg.loss_agg_mode),
    )
    bonus = entropy_bonus(ent, batch.mask, cfg.loss_agg_mode)
    kl = agg_loss(kl_penalty(lp, batch.ref_log_probs, cfg.kl_kind), batch.mask, cfg.loss_agg_mode)
    loss = pg - cfg.entropy_coeff * bonus + cfg.kl_coef * kl
    metrics = {k.removeprefix("actor/"): v.item() for k, v in metrics.items()}  # verl's "actor/..." names
    metrics.update(
        entropy=agg_loss(ent.detach(), batch.mask, "token-mean").item(), kl=kl.item(), pg_loss=pg.item()
    )
    return loss, metrics


def loss_and_grads(model: TinyCausalLM, batch: Rollout, *, fused: bool = True):
    """``(loss, metrics, {name: grad})`` at the current parameters; ``.grad`` is left untouched."""
    loss, metrics = grpo_loss(model, batch, fused=fused)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad], strict=True)
    grads = torch.autograd.grad(loss, params)
    return loss.item(), metrics, dict(zip(names, grads, strict=True))


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)  # per optimizer step
    metrics: list = field(default_factory=list)  # per step: entropy, pg_clipfrac, ppo_kl, kl, reward, ...
    grads: list = field(default_factory=list)  # per step: {parameter name: gradient} (this rank's shard)


def train(
    steps: int,
    *,
    fused: bool = True,
    tp_group=None,
    config: Optional[GRPOConfig] = None,
    on_step: Optional[Callable] = None,
    log: Optional[Callable[[str], None]] = None,
) -> TrainResult:
    """Run ``steps`` GRPO optimizer steps; return per-step losses, metrics and gradients.

    Args:
        steps: optimizer steps (a new rollout every ``config.ppo_epochs`` steps).
        fused: the chunked fused head (True) or gathered full logits with a
            float64 log-softmax (False).
        tp_group: the tensor-parallel group, or None for a single process.
        config: a :class:`GRPOConfig` (defaults if None).
        on_step: called as ``on_step(step, model, batch, loss, grads)`` after
            the gradients and before the optimizer step.
        log: called with one line per step (e.g. ``print`` on rank 0).
    """
    cfg = config or GRPOConfig()
    model = TinyCausalLM(cfg, tp_group)
    ref_model = TinyCausalLM(cfg, tp_group).requires_grad_(False)  # same seed: the initial policy
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = torch.randint(2, cfg.vocab_size, (cfg.num_prompts, cfg.prompt_len), generator=gen)
    result = TrainResult()
    batch = None
    for step in range(1, steps + 1):
        if (step - 1) % cfg.ppo_epochs == 0:
            batch = rollout(model, ref_model, prompts, gen)
        loss, metrics, grads = loss_and_grads(model, batch, fused=fused)
        metrics["reward"] = float(batch.rewards.mean())
        if on_step is not None:
            on_step(step, model, batch, loss, grads)
        with torch.no_grad():  # plain SGD; a real run would use torch.optim.AdamW (whose first
            for name, p in model.named_parameters():  # use imports torch._dynamo: seconds, here)
                p.sub_(grads[name], alpha=cfg.lr)
        result.losses.append(loss)
        result.metrics.append(metrics)
        result.grads.append({k: v.detach().clone() for k, v in grads.items()})
        if log is not None:
            log(
                f"step {step} loss {loss:+.6f} entropy {metrics['entropy']:.6f} "
                f"reward {metrics['reward']:.4f} clipfrac {metrics['pg_clipfrac']:.4f} "
                f"ppo_kl {metrics['ppo_kl']:+.6f}"
            )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--unfused", action="store_true", help="gather full logits (float64 log_softmax) instead")
    defaults = GRPOConfig()
    for name, value in asdict(defaults).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--loss-agg-mode", default=defaults.loss_agg_mode)
    args = parser.parse_args(argv)
    cfg = GRPOConfig(**{k: getattr(args, k) for k in asdict(defaults) if hasattr(args, k)})

    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    if distributed:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    group = dist.group.WORLD if distributed else None
    rank, world = _tp(group)
    log = functools.partial(print, flush=True) if rank == 0 else None
    if log:
        print(f"GRPO on a tiny causal LM: TP={world}, vocab {cfg.vocab_size} ({cfg.vocab_size // world} per rank), "
              f"{'unfused (full logits)' if args.unfused else 'fused ChunkedVocabParallelHead'}", flush=True)
    try:
        train(args.steps, fused=not args.unfused, tp_group=group, config=cfg, log=log)
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
