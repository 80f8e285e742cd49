"""Peak memory and time at verl's Megatron output layer, every route, with and without the verl plugin.

On the same head (hidden states ``[T, H]``, output weight ``[V, H]``, float32,
TP 1, one packed sequence, temperature 1), one forward+backward of
``sum(g_lp * log_prob + g_h * entropy)`` per case, each case in a fresh
interpreter after a warm-up on a few tokens; the peak is the resident memory
over the inputs, measured by ``chunked-entropy bench``'s own ``CpuMemory``:

- ``head``: the library's fused head alone (``linear_log_probs_and_entropy``);
- ``verlunfused``: verl's unfused route: the output layer's logits, then verl's
  own ``MegatronEngineWithLMHead._lm_head_logits_processor``;
- ``verlplugin``: the same logits through the plugin's processor;
- ``verlfused``: the fused route with the plugin (its ``fused_output_processor``);
- ``verlmtp``: one MTP layer's loss as verl's ``_megatron_gptmodel_postprocess``
  computes it on megatron-core 0.16.1 (the detached output weight's logits,
  megatron-core's ``vocab_parallel_cross_entropy``, verl's scale, attached with
  ``MTPLossAutoScaler``);
- ``mtp``: the same with the plugin (``chunked_entropy.integrations.verl.mtp.mtp_losses``).

verl's fused route without the plugin is verl's Triton kernel (CUDA only): not
measured here.

    python benchmarks/verl_megatron_memory.py                     # T=8192, V=32768, H=256, chunk 512
    python benchmarks/verl_megatron_memory.py --tokens 4096

It lives here, not in ``chunked-entropy bench``: the command line uses only
the library's public API, and these cases run the verl plugin's modules.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings

import torch
import torch.distributed as dist

from chunked_entropy.cli._measure import CpuMemory

METHODS = {
    "head": "the library's fused head alone",
    "verlunfused": "verl, unfused route (output layer + verl's logits processor)",
    "verlplugin": "verl, unfused route with the plugin",
    "verlfused": "verl, fused route with the plugin",
    "verlmtp": "verl, one MTP layer's loss, verl's own",
    "mtp": "verl, one MTP layer's loss with the plugin",
}


def _inputs(n, a):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, a.hidden, generator=g).requires_grad_()
    weight = torch.randn(a.vocab, a.hidden, generator=g).mul_(2.0 / a.hidden**0.5).requires_grad_()
    labels = torch.randint(0, a.vocab, (1, n), generator=g)
    return hidden, weight, labels, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _loss(method, a, hidden, weight, labels, g_lp, g_h):
    from chunked_entropy import linear_log_probs_and_entropy
    from chunked_entropy.integrations import verl as ce_verl
    from chunked_entropy.integrations.verl import megatron_fused, mtp

    n = hidden.shape[0]
    t = torch.ones(1, n)
    layer = types.SimpleNamespace(weight=weight, bias=None, tp_group=None, sequence_parallel=False)
    if method == "head":
        out = linear_log_probs_and_entropy(hidden, weight, labels[0], chunk_size=a.chunk)
        return (out.log_probs * g_lp).sum() + (out.entropy * g_h).sum()
    if method == "verlfused":
        request = megatron_fused.FusedRequest(temperature=t, chunk_size=a.chunk)
        out = megatron_fused.fused_output_processor(hidden_states=hidden.view(n, 1, -1), output_layer=layer,
                                                    output_weight=None, labels=labels, context=request, config=layer)
        return (out["log_probs"][0] * g_lp).sum() + (out["entropy"][0] * g_h).sum()
    if method in ("mtp", "verlmtp"):  # one MTP layer on the same hidden states (the main part too)
        model = types.SimpleNamespace(output_layer=layer, cp_group=None, training=False, config=types.SimpleNamespace(
            mtp_num_layers=1, mtp_loss_scaling_factor=1.0, calculate_per_token_loss=False))
        h = hidden.view(n, 1, -1)
        if method == "mtp":
            return mtp.mtp_losses(model, torch.cat([h, h]), labels, None, output_weight=None, packed_seq_params=None,
                                  chunk_size=a.chunk).sum() * 0.0
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        mtp_labels = torch.roll(labels, -1, -1)
        mask = torch.ones_like(mtp_labels)
        mask[..., -1] = 0
        logits = h @ weight.detach().t()  # verl detaches the output layer for the MTP loss
        loss = mask * vocab_parallel_cross_entropy(logits, mtp_labels.t()).t()
        return MTPLossAutoScaler.apply(h, loss / mask.sum()).sum() * 0.0
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = object.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(entropy_from_logits_chunk_size=a.chunk)
    processor = ce_verl.lm_head_logits_processor if method == "verlplugin" \
        else MegatronEngineWithLMHead.__dict__["_lm_head_logits_processor"]
    logits = (hidden @ weight.t()).view(1, n, -1)
    out = processor(engine, logits, labels, t, calculate_sum_pi_squared=False, calculate_entropy=True,
                    distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
                    data_format="thd")
    return (out["log_probs"][0] * g_lp).sum() + (out["entropy"][0] * g_h).sum()


def _case(method: str, a) -> dict:
    """One measurement, in this (fresh) process."""
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):  # stdout is the protocol; verl prints
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(1)
        _loss(method, a, *_inputs(min(a.tokens, 64), a)).backward()  # warm-up: imports, thread pools
    inputs = _inputs(a.tokens, a)
    memory = CpuMemory()  # chunked-entropy bench's own measurement: peak resident memory over the inputs
    memory.reset()
    t0 = time.perf_counter()
    _loss(method, a, *inputs).backward()
    seconds = time.perf_counter() - t0
    return {"peak_bytes": memory.peak(), "time_s": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=512, help="chunk size of the library's routes (default 512)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(_case(a.case, a)), flush=True)
        return 0
    methods = a.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown --methods {unknown}; expected some of {list(METHODS)}")
    results = {m: [] for m in methods}
    for r in range(a.repeats):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:  # rotated: none always first
            out = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--case", m],
                                 capture_output=True, text=True, check=True).stdout
            results[m].append(json.loads(out.strip().splitlines()[-1]))
    logits = a.tokens * a.vocab * 4
    print(f"T={a.tokens}, V={a.vocab}, H={a.hidden}, float32, TP 1, chunk {a.chunk}, {a.repeats} rounds")
    print("| method | peak extra memory | x float32 [T, V] | time fwd+bwd (median) |")
    print("|---|---:|---:|---:|")
    for m, rows in results.items():
        peak = statistics.median(r["peak_bytes"] for r in rows)
        times = sorted(r["time_s"] for r in rows)
        print(f"| {METHODS[m]} | {peak / 2**20:.1f} MiB | {peak / logits:.3f} | {statistics.median(times):.3f} s "
              f"({times[0]:.2f}-{times[-1]:.2f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
