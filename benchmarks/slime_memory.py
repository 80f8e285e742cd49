"""Peak memory and time of slime's log-probs and entropy: slime's own code against the plugin.

slime's ``get_log_probs_and_entropy`` (imported from a source checkout, at the
commit given) and ``chunked_entropy.integrations.slime.get_log_probs_and_entropy``
run on the same input, the way slime's training step calls them: packed
float32 logits ``[1, T, V]`` at TP 1, the rollout temperature, the entropy
with its gradient (an entropy bonus), and top-p replay sets for every
response token. One forward+backward of ``sum(g_lp * log_prob + g_h * entropy)``
per case, each case in a fresh interpreter; the peak is the
resident memory over the inputs, measured by ``chunked-entropy bench``'s own
``CpuMemory`` (``/proc/self/clear_refs``, glibc made to return freed memory).

    python benchmarks/slime_memory.py --slime-src /path/to/slime   # checked out at 624b824a

With ``--hidden H`` the step starts one level up, at the decoder's output:
float32 hidden states ``[T, 1, H]`` and a megatron-core ``ColumnParallelLinear``
output layer ``[V, H]``, and four methods run: slime's own (the output layer's
``[1, T, V]`` logits, then slime's function), the plugin's logits route (the
same logits, the plugin's function), the plugin's hidden-state route (a
:class:`~chunked_entropy.integrations.slime.HiddenStates`, as the patched
post-processing hands it on: only the response rows are projected), and the
fused head on the response rows alone (``linear_log_probs_and_entropy`` on
``hidden[rows]``, the target's floor). The gradients of the hidden states and
the weight are allocated by every method alike.

    python benchmarks/slime_memory.py --slime-src /path/to/slime --hidden 1024 --prompt 384 --repeats 1

slime needs megatron-core and httpx to import its loss module.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

from chunked_entropy.cli._measure import CpuMemory

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def _inputs(a):
    """slime's arguments for one packed micro-batch: samples of ``a.sample`` tokens, ``a.prompt`` of them prompt."""
    g = torch.Generator().manual_seed(0)
    n_samples = a.tokens // a.sample
    totals, resps = [a.sample] * n_samples, [a.sample - a.prompt] * n_samples
    tokens = [torch.randint(0, a.vocab, (a.sample,), generator=g) for _ in range(n_samples)]
    ids = [torch.randint(0, a.vocab, (r * a.keep,), generator=g).tolist() for r in resps]
    offsets = [list(range(0, r * a.keep + 1, a.keep)) if a.keep else [] for r in resps]
    topp = dict(top_p_token_ids=ids, top_p_token_offsets=offsets) if a.keep else {}
    if getattr(a, "hidden", 0):  # the step makes its own hidden states; this only carries T
        logits = torch.empty(1, a.tokens, 0)
    else:
        logits = torch.randn(1, a.tokens, a.vocab, generator=g).mul_(2.0).requires_grad_()
    ups = [(torch.randn(r, generator=g), torch.randn(r, generator=g)) for r in resps]
    args = argparse.Namespace(rollout_temperature=a.temperature, log_probs_chunk_size=a.chunk, entropy_coef=0.01,
                              allgather_cp=False, rollout_top_p=0.95)
    return logits, dict(args=args, unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps,
                        with_entropy=True, **topp), ups


class _Model:
    """What :class:`HiddenStates` reads of a megatron-core model: its output layer (untied)."""

    share_embeddings_and_output_weights = False

    def __init__(self, output_layer):
        self.output_layer = output_layer


def _output_layer(a):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    return ColumnParallelLinear(a.hidden, a.vocab, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=False,
                                gather_output=False, skip_bias_add=True)


def _hidden_step(method, fn, layer, a):
    """One step from the decoder's output (``--hidden``): the projection is part of what is measured."""
    from chunked_entropy import linear_log_probs_and_entropy
    from chunked_entropy.integrations.slime import HiddenStates

    def step(logits_in, kw, ups):
        g = torch.Generator().manual_seed(1)
        hidden = (torch.randn(logits_in.shape[1], 1, a.hidden, generator=g) / 4).requires_grad_()
        del logits_in
        if method == "rows":  # the fused head on the response rows alone
            totals, resps = kw["total_lengths"], kw["response_lengths"]
            rows = torch.cat([torch.arange(start + t - r - 1, start + t - 1)
                              for start, t, r in zip(torch.tensor([0] + totals).cumsum(0)[:-1].tolist(), totals, resps,
                                                     strict=True)])
            labels = torch.cat([tok[-r:] for tok, r in zip(kw["unconcat_tokens"], resps, strict=True)])
            out = linear_log_probs_and_entropy(hidden.view(-1, a.hidden)[rows], layer.weight, labels,
                                               chunk_size=DEFAULT_CHUNK, temperature=a.temperature)
            up_lp = torch.cat([u[0] for u in ups])
            up_h = torch.cat([u[1] for u in ups])
            ((out.log_probs * up_lp).sum() + (out.entropy * up_h).sum()).backward()
            return
        if method == "hidden":
            x = HiddenStates(hidden, _Model(layer))
        else:
            x = layer(hidden)[0].transpose(0, 1).float()  # megatron-core's post-processing, then Float16Module
        _, res = fn(x, **kw)
        loss = sum((lp * u[0]).sum() + (h * u[1]).sum()
                   for lp, h, u in zip(res["log_probs"], res["entropy"], ups, strict=True))
        loss.backward()

    return step


DEFAULT_CHUNK = 512


def _case(method: str, a) -> dict:
    """One measurement, in this (fresh) process."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(1)
        if method == "slime":
            sys.path.append(a.slime_src)
            from slime.backends.megatron_utils.loss import get_log_probs_and_entropy as fn
        else:
            from chunked_entropy.integrations.slime import get_log_probs_and_entropy as fn

    def step(logits, kw, ups):
        _, res = fn(logits, **kw)
        loss = sum((lp * u[0]).sum() + (h * u[1]).sum()
                   for lp, h, u in zip(res["log_probs"], res["entropy"], ups, strict=True))
        loss.backward()

    if a.hidden:
        if a.keep:
            raise SystemExit("--hidden compares against the fused head on the response rows alone: use --keep 0")
        step = _hidden_step(method, fn, _output_layer(a), a)

    small = argparse.Namespace(**{**vars(a), "tokens": a.sample})  # a warm-up on one sample
    step(*_inputs(small))
    logits, kw, ups = _inputs(a)
    memory = CpuMemory()  # chunked-entropy bench's own measurement: peak resident memory over the inputs
    memory.reset()
    t0 = time.perf_counter()
    step(logits, kw, ups)
    seconds = time.perf_counter() - t0
    return {"peak_bytes": memory.peak(), "time_s": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slime-src", required=True, help=f"a checkout of THUDM/slime (checked at {SLIME_COMMIT[:8]})")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--sample", type=int, default=512, help="tokens per packed sample (default 512)")
    p.add_argument("--prompt", type=int, default=64, help="of which prompt (default 64)")
    p.add_argument("--keep", type=int, default=64, help="top-p kept ids per response token (default 64; 0: none)")
    p.add_argument("--hidden", type=int, default=0,
                   help="start at the decoder's output of this width (see above); default 0: at the logits")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--chunk", type=int, default=-1,
                   help="--log-probs-chunk-size of both (default -1, slime's own: no chunking for slime)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(_case(a.case, a)), flush=True)
        return 0
    commit = subprocess.run(["git", "-C", a.slime_src, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    results = {"slime": [], "plugin": []} if not a.hidden else {"slime": [], "plugin": [], "hidden": [], "rows": []}
    for _ in range(a.repeats):
        for method in results:  # each case a fresh interpreter: no allocator or thread-pool state carried over
            out = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--case", method],
                                 capture_output=True, text=True, check=True).stdout
            results[method].append(json.loads(out.strip().splitlines()[-1]))
    grad = a.tokens * a.vocab * 4
    resp = (a.sample - a.prompt) / a.sample
    print(f"slime at {commit.strip() or '?'}; T={a.tokens}, V={a.vocab}, float32, TP 1, temperature "
          f"{a.temperature}, entropy bonus on, {a.keep} top-p ids per response token, chunk {a.chunk}"
          + (f"; from hidden states H={a.hidden}, {resp:.0%} response rows" if a.hidden else ""))
    print("| method | peak extra memory | x the logits' gradient | time fwd+bwd (median) |")
    print("|---|---:|---:|---:|")
    for method, rows in results.items():
        peak = statistics.median(r["peak_bytes"] for r in rows)
        times = sorted(r["time_s"] for r in rows)
        label = {"slime": "slime's own get_log_probs_and_entropy",
                 "plugin": "the plugin" + (", logits route" if a.hidden else ""),
                 "hidden": "the plugin, hidden-state route",
                 "rows": "fused head on the response rows alone"}[method]
        print(f"| {label} | {peak / 2**20:.0f} MiB | {peak / grad:.3f} | {statistics.median(times):.3f} s "
              f"({times[0]:.2f}-{times[-1]:.2f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
