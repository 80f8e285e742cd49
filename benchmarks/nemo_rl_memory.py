"""Peak memory and time of NeMo-RL's loss-path log-probs: NeMo-RL's own code against the plugin.

NeMo-RL's ``prepare_loss_input`` with its ``ClippedPGLossFn`` (both imported
from a source checkout, at the commit given) runs on the same micro-batch
without and with ``chunked_entropy.integrations.nemo_rl.install()``: bf16
logits ``[1, T / cp, V]``, TP 1 (a group of one rank, NeMo-RL's Megatron
route), ``logprob_chunk_size: null`` (NeMo-RL's default), the reference-KL
penalty on. Each case in a fresh interpreter; the peak is the resident memory
over the inputs, measured by ``chunked-entropy bench``'s own ``CpuMemory``.

- ``--cp 1``: one forward+backward of the loss;
- ``--cp 2`` (NeMo-RL #4222's layout, TP 1 and CP 2, scaled down): forward
  only, rank 0 measured. NeMo-RL's ``AllGatherCPTensor.backward`` pins host
  memory and calls ``.cuda()``, so its backward cannot run on a CPU; #4222's
  two float32 tensors are both made in forward.

    python benchmarks/nemo_rl_memory.py --nemo-rl-src /path/to/RL            # T = 8192, V = 32768
    python benchmarks/nemo_rl_memory.py --nemo-rl-src /path/to/RL --cp 2
    python benchmarks/nemo_rl_memory.py --nemo-rl-src /path/to/RL --top-p 0.9 --scale 4   # filtered log-probs

``--loss distillation`` runs NeMo-RL's ``DistillationLossFn(kl_type="mixed",
zero_outside_topk=True)`` instead (the teacher's top-``--teacher-k`` logits
and ids, default 64; the student's log-probs at those ids over the whole
vocabulary and ``H_all``).

``--top-p`` / ``--top-k`` turn on NeMo-RL's top-k/top-p filtered log-probs
(``sampling_params``); ``--scale`` is the logits' standard deviation (how
many ids a top-p keeps: at ``V = 32768``, top-p 0.9 keeps about 200 ids per
row at scale 4 and 7700 at scale 2).

The loss modules import with NeMo-RL's two package modules that need
transformers < 5.12 and mlflow registered as stand-ins, as in
``tests/test_integrations_nemo_rl.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunked_entropy.cli._measure import CpuMemory

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(a, cp, cp_rank, model_utils):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    t = a.tokens
    data = BatchedDataDict({
        "input_ids": torch.randint(0, a.vocab, (1, t), generator=g),
        "token_mask": torch.ones(1, t), "sample_mask": torch.ones(1),
        "advantages": torch.randn(1, t, generator=g), "prev_logprobs": -torch.rand(1, t, generator=g),
        "generation_logprobs": -torch.rand(1, t, generator=g),
        "reference_policy_logprobs": -torch.rand(1, t, generator=g),
    })
    if a.loss == "distillation":  # the teacher's top-k: logits and distinct ids per token
        data["teacher_topk_logits"] = torch.randn(1, t, a.teacher_k, generator=g) * 2
        step = a.vocab // a.teacher_k
        data["teacher_topk_indices"] = (torch.randint(0, a.vocab, (1, t, 1), generator=g)
                                        + torch.arange(a.teacher_k) * step) % a.vocab
    logits = (torch.randn(1, t // cp, a.vocab, generator=torch.Generator().manual_seed(1 + cp_rank)) * a.scale)
    return data, logits.to(torch.bfloat16).requires_grad_()


def _measure(a, method, cp, rank):
    os.environ["CHUNKED_ENTROPY_NEMO_RL_SRC"] = a.nemo_rl_src  # read by the tests' one loader of NeMo-RL
    from tests.test_integrations_nemo_rl import _import_nemo_rl

    model_utils, loss_utils, loss_functions, sampling = _import_nemo_rl()
    params = None
    if a.top_k is not None or a.top_p != 1.0:
        params = sampling.TrainingSamplingParams(top_k=a.top_k, top_p=a.top_p)
    if method == "plugin":
        from chunked_entropy.integrations import nemo_rl as ce_nemo_rl

        ce_nemo_rl.install()
    one = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # TP 1: a group of this rank alone
    cp_group = dist.group.WORLD if cp > 1 else None
    if a.loss == "distillation":
        loss_fn = loss_functions.DistillationLossFn(loss_functions.DistillationLossConfig(kl_type="mixed",
                                                                                         zero_outside_topk=True))
    else:
        loss_fn = loss_functions.ClippedPGLossFn(loss_functions.ClippedPGLossConfig(reference_policy_kl_penalty=0.01))

    def step(data, logits):
        loss_input, data = loss_utils.prepare_loss_input(logits, data, loss_fn, vocab_parallel_rank=0,
                                                         vocab_parallel_group=one, context_parallel_group=cp_group,
                                                         sampling_params=params)
        loss, _ = loss_fn(data=data, global_valid_seqs=torch.tensor(1.0),
                          global_valid_toks=data["token_mask"][:, 1:].sum(), **loss_input)
        if cp == 1:
            loss.backward()
        return loss

    small = argparse.Namespace(**{**vars(a), "tokens": 64 * cp})
    step(*_inputs(small, cp, rank, model_utils))  # warm-up
    data, logits = _inputs(a, cp, rank, model_utils)
    memory = CpuMemory()
    memory.reset()
    if cp > 1:
        dist.barrier()
    t0 = time.perf_counter()
    loss = step(data, logits)
    seconds = time.perf_counter() - t0
    del loss
    return {"peak_bytes": memory.peak(), "time_s": seconds}


def _rank(rank, world, a, method, store, out):
    torch.set_num_threads(1 if world > 1 else torch.get_num_threads())
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = _measure(a, method, world, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _case(method: str, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(_rank, args=(a.cp, a, method, os.path.join(d, "store"), out), nprocs=a.cp)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nemo-rl-src", required=True, help="a checkout of NVIDIA-NeMo/RL")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--cp", type=int, default=1, choices=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scale", type=float, default=2.0, help="the logits' standard deviation")
    p.add_argument("--top-k", type=int, default=None, help="NeMo-RL's filtered log-probs: top-k")
    p.add_argument("--top-p", type=float, default=1.0, help="NeMo-RL's filtered log-probs: top-p")
    p.add_argument("--loss", choices=["clipped_pg", "distillation"], default="clipped_pg",
                   help="NeMo-RL's ClippedPGLossFn (reference KL on), or DistillationLossFn (mixed KL, "
                        "zero_outside_topk)")
    p.add_argument("--teacher-k", type=int, default=64, help="distillation: the teacher's top-k")
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(_case(a.case, a)), flush=True)
        return 0
    commit = subprocess.run(["git", "-C", a.nemo_rl_src, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    results = {"nemo_rl": [], "plugin": []}
    for _ in range(a.repeats):
        for method in results:  # each case a fresh interpreter
            out = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--case", method],
                                 capture_output=True, text=True, check=True).stdout
            results[method].append(json.loads(out.strip().splitlines()[-1]))
    logits = a.tokens // a.cp * a.vocab * 2
    what = "forward+backward" if a.cp == 1 else "forward (rank 0)"
    if not commit:  # a checkout without git metadata (git archive): the commit the tests pin
        from chunked_entropy.integrations.nemo_rl import NEMO_RL_COMMIT as commit
    print(f"NeMo-RL at {commit}; T={a.tokens}, V={a.vocab}, bf16 logits, TP 1, CP {a.cp}, "
          f"logprob_chunk_size null, "
          + ("ClippedPGLossFn with the reference KL" if a.loss == "clipped_pg" else
             f"DistillationLossFn mixed KL, zero_outside_topk, teacher top-{a.teacher_k}")
          + f"; {what}; logits scale {a.scale}, "
          f"top_k {a.top_k}, top_p {a.top_p}")
    print(f"| method | peak extra memory | x the bf16 logits | time {what} (median) |")
    print("|---|---:|---:|---:|")
    for method, rows in results.items():
        peak = statistics.median(r["peak_bytes"] for r in rows)
        times = sorted(r["time_s"] for r in rows)
        label = {"nemo_rl": "NeMo-RL's own", "plugin": "the plugin"}[method]
        print(f"| {label} | {peak / 2**30:.2f} GiB | {peak / logits:.3f} | {statistics.median(times):.3f} s "
              f"({times[0]:.2f}-{times[-1]:.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
