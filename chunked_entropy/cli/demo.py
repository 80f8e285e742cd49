"""``chunked-entropy demo``: the failure this library fixes, the stop-gap, and the fix.

1. The seed failure, for real: an entropy function that saves the float32
   logits for backward (as verl's vocab-parallel entropy does), then a
   log-prob computed the way Megatron's ``vocab_parallel_cross_entropy`` does
   it, overwriting those same logits with the softmax, in place; backward
   raises "modified by an inplace operation". Caught and explained.
2. The clone workaround: the in-place log-prob gets ``logits.clone()``. It
   works, and costs one more [tokens, V] float32 tensor.
3. This library on the same input: ``log_probs_and_entropy``; values and
   gradients checked against a float64 reference; the logits are left
   bitwise unchanged.
4. The peak memory of each approach over the logits during forward+backward,
   each measured in a fresh process (peak resident memory on CPU,
   ``torch.cuda.max_memory_allocated`` on CUDA).

``--tp N`` shards the vocabulary over N processes (gloo on CPU, NCCL on
CUDA) that it spawns; launched under ``torchrun`` it uses the ranks torchrun
started instead. The loss is ``sum(g_lp * log_prob + g_h * entropy)`` with
random upstream gradients, as an RL loss with an entropy bonus would give.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
import time

TOLERANCE = 1e-5  # float32 against float64, relative to the largest reference value


class DemoError(Exception):
    """A user mistake (bad device, bad --tp): one line, exit code 2."""


def add_arguments(p, positive_int) -> None:
    p.add_argument("--tokens", type=positive_int, default=2048,
                   help="tokens (rows of the logits) (default 2048)")
    p.add_argument("--vocab", type=positive_int, default=16384,
                   help="global vocabulary size, divisible by --tp (default 16384)")
    p.add_argument("--chunk-size", type=positive_int, default=256,
                   help="chunk_size of this library (default 256)")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="shard the vocabulary over N processes (gloo on CPU, NCCL on CUDA); under "
                        "torchrun the launched ranks are used (default 1, or torchrun's WORLD_SIZE)")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda (default cpu); cuda needs a GPU and a CUDA build of torch")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory measurements (step 4), which start a fresh process per approach")


# --------------------------------------------------------------------------- inputs and checks


def _inputs(args, rank, world, device):
    """The full problem (same on every rank, from the seed) and this rank's shard of the logits."""
    import torch

    g = torch.Generator().manual_seed(args["seed"])
    n, v = args["tokens"], args["vocab"]
    full = torch.randn(n, v, generator=g).mul_(2.0)
    labels = torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g)
    g_h = torch.randn(n, generator=g)
    vl = v // world
    shard = full[:, rank * vl : (rank + 1) * vl]
    return full, shard.to(device), labels.to(device), g_lp.to(device), g_h.to(device)


def _reference(full, labels, g_lp, g_h, rank, world, rows=256):
    """float64 log-probs, entropy, and this rank's columns of the gradient (row block by row block)."""
    import torch

    from .baselines import reference_float64

    n, v = full.shape
    vl = v // world
    lp, ent, grad = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64), []
    for a in range(0, n, rows):
        b = min(a + rows, n)
        lp[a:b], ent[a:b], gz = reference_float64(full[a:b], labels[a:b].cpu(), g_lp[a:b].cpu(), g_h[a:b].cpu())
        grad.append(gz[:, rank * vl : (rank + 1) * vl])
    return lp, ent, torch.cat(grad)


def _rel_err(x, ref) -> float:
    x = x.detach().double().cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _max_over(value: float, group) -> float:
    if group is None:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


# --------------------------------------------------------------------------- the steps


def _say(rank, *lines):
    if rank == 0:
        for line in lines:
            print(line)
        sys.stdout.flush()


def _wrap(text, indent="   "):
    return textwrap.fill(" ".join(text.split()), width=96, initial_indent=indent, subsequent_indent=indent)


def demo_steps(args, rank, world, group, device) -> dict:
    """Steps 1-3 on this rank; prints on rank 0; returns the checks (maxed over ranks)."""
    import torch

    from chunked_entropy import OutputLayer, log_probs_and_entropy

    from .baselines import clone_workaround, seed_failure

    n, v, c = args["tokens"], args["vocab"], args["chunk_size"]
    full, shard, labels, g_lp, g_h = _inputs(args, rank, world, device)
    ref_lp, ref_ent, ref_grad = _reference(full, labels, g_lp, g_h, rank, world)
    del full
    vl = v // world
    mib = n * vl * 4 / 2**20

    def loss(lp, ent):
        return (lp * g_lp).sum() + (ent * g_h).sum()

    _say(rank, f"chunked-entropy demo: {n} tokens x {v} vocabulary"
               + (f" (tp={world}: {vl} columns per rank)" if world > 1 else "")
               + f", float32 logits on {device}: {mib:.1f} MiB" + (" per rank" if world > 1 else "") + ".",
         "Loss: sum(g_lp * log_prob + g_h * entropy), random upstream gradients (an entropy bonus).", "")

    # 1. the seed failure
    _say(rank, "1) The seed failure: an entropy that saves the logits, then an in-place log-prob on them",
         "   entropy   = naive_entropy(logits)              # saves logits for backward (like verl's)",
         "   log_probs = inplace_log_probs(logits, labels)  # writes softmax into logits (like Megatron's",
         "                                                  # vocab_parallel_cross_entropy on float32)",
         "   loss.backward()")
    logits = shard.clone().requires_grad_(True)
    lp, ent = seed_failure(logits, labels, group)
    version = logits._version
    failed = None
    try:
        loss(lp, ent).backward()
    except RuntimeError as e:
        failed = str(e)
    if failed and "modified by an inplace operation" in failed:
        first = failed.split(". ")[0].split("\n")[0]
        _say(rank, "   -> RuntimeError: " + first[:400] + ".", "",
             _wrap(f"Why: naive_entropy saved the float32 logits (version 0) to rebuild its gradient. "
                   f"inplace_log_probs then overwrote that same tensor with the softmax, in place (it "
                   f"saves a [tokens, V] buffer that way): its version counter went from 0 to {version} in "
                   f"forward (its own backward, which reuses the buffer, bumps it again before the check). In "
                   f"backward, autograd checks the version of every saved tensor and refuses to compute a gradient "
                   f"from data that changed. Had the entropy come second, nothing would raise: it would "
                   f"silently be the entropy of the softmax. The usual fix is a clone (step 2)."), "")
    else:
        _say(rank, "   -> did not raise the expected in-place error" + (f": {failed}" if failed else "") + ".", "")
    del logits, lp, ent

    # 2. the clone workaround
    _say(rank, "2) The clone workaround: the in-place log-prob gets its own copy",
         "   log_probs = inplace_log_probs(logits.clone(), labels)")
    logits = shard.clone().requires_grad_(True)
    lp, ent = clone_workaround(logits, labels, group)
    loss(lp, ent).backward()
    clone_err = _max_over(max(_rel_err(logits.grad, ref_grad), _rel_err(lp, ref_lp), _rel_err(ent, ref_ent)), group)
    _say(rank, f"   -> works (max error vs float64, relative: {clone_err:.1e}), at the price of the clone: "
               f"one more [tokens, V] float32",
         f"      tensor (+{mib:.1f} MiB" + (" per rank" if world > 1 else "")
         + "), on top of the softmax each of the two functions keeps for backward (step 4).", "")
    del logits, lp, ent

    # 3. this library
    grp = ", layer=OutputLayer(process_group=group)" if world > 1 else ""
    _say(rank, "3) chunked_entropy: statistics per chunk, nothing written into the logits",
         f"   log_probs, entropy = log_probs_and_entropy(logits, labels, chunking={c}{grp})")
    logits = shard.clone().requires_grad_(True)
    before = logits.detach().clone()
    v0 = logits._version
    t0 = time.perf_counter()
    layer = None if group is None else OutputLayer(process_group=group)
    lp, ent = log_probs_and_entropy(logits, labels, chunking=c, layer=layer)
    loss(lp, ent).backward()
    elapsed = time.perf_counter() - t0
    errs = {
        "log_probs": _max_over(_rel_err(lp, ref_lp), group),
        "entropy": _max_over(_rel_err(ent, ref_ent), group),
        "grad": _max_over(_rel_err(logits.grad, ref_grad), group),
    }
    unchanged = bool(torch.equal(before, logits.detach())) and logits._version == v0
    unchanged = _max_over(0.0 if unchanged else 1.0, group) == 0.0
    ok = all(e <= TOLERANCE for e in errs.values()) and unchanged
    _say(rank, f"   -> forward+backward in {elapsed:.2f} s; against float64 (max error relative to the largest "
               f"value, tolerance {TOLERANCE:g}):",
         f"      log_probs {errs['log_probs']:.1e}, entropy {errs['entropy']:.1e}, "
         f"gradient of the logits {errs['grad']:.1e}" + (" (every rank, its own shard)" if world > 1 else ""),
         f"      logits bitwise unchanged, version counter unchanged: {'yes' if unchanged else 'NO'}",
         f"   gradient check: {'PASSED' if ok else 'FAILED'}", "")
    return {"ok": ok, "errors": errs, "unchanged": unchanged, "reproduced": bool(failed), "clone_error": clone_err}


# --------------------------------------------------------------------------- memory (step 4)


def memory_table(args, world, device) -> list:
    """Peak memory over the logits of each approach, each in a fresh process."""
    from ._methods import Case
    from ._process import run_fresh

    n, v, c = args["tokens"], args["vocab"], args["chunk_size"]
    methods = (["plain"] if world == 1 else []) + ["clone", "chunked"]
    rows = []
    print(f"4) Peak memory over the logits during forward+backward (gradient included), each approach in "
          f"a fresh process{' per rank' if world > 1 else ''}:", flush=True)
    for m in methods:
        case = Case(path="logits", method=m, tokens=n, vocab=v, chunk=c if m == "chunked" else 0,
                    device=device, tp=world, seed=args["seed"])
        res = run_fresh(case)
        rows.append((case, res))
    lb = n * (v // world) * 4
    names = {"plain": "plain torch (log_softmax, gather, -(p*logp).sum)",
             "clone": "clone workaround (step 2)", "chunked": f"chunked_entropy, chunk {c} (step 3)"}
    print("", "   | approach | peak extra memory | x logits |", "   |---|---:|---:|",
          "   | seed code (step 1) | fails | - |", sep="\n")
    for case, res in rows:
        if res["status"] == "ok":
            p = res["peak_bytes"]
            print(f"   | {names[case.method]} | {p / 2**20:.1f} MiB | {p / lb:.2f} |")
        else:
            print(f"   | {names[case.method]} | {res['status']}: {res.get('error', '')} | - |")
    how = ("peak resident memory of the process" if device == "cpu" else "torch.cuda.max_memory_allocated()")
    print("", _wrap(f"Measured as {how} minus its value once the logits exist"
                    + (", the largest over the ranks" if world > 1 else "")
                    + f"; x logits: that peak / the {lb / 2**20:.1f} MiB logits"
                    + (" shard" if world > 1 else "") + ". The gradient alone is 1x. "
                    "'chunked-entropy bench' sweeps shapes; 'chunked-entropy plan' predicts them."), sep="\n")
    return rows


# --------------------------------------------------------------------------- processes


def _check(args, world) -> str:
    import torch

    dev = args["device"]
    if dev not in ("cpu", "cuda") and not dev.startswith("cuda:"):
        raise DemoError(f"--device: expected cpu or cuda, got {dev!r}")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device is available here (this torch build or machine has none)")
    if dev.startswith("cuda") and world > torch.cuda.device_count():
        raise DemoError(f"--tp {world} with --device cuda needs {world} GPUs, found {torch.cuda.device_count()}")
    if args["vocab"] % world:
        raise DemoError(f"--vocab {args['vocab']} must be divisible by the tensor-parallel size {world}")
    return dev


def _rank_device(dev: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if dev.startswith("cuda") else "cpu"


def _spawned_rank(rank, world, port, args, result_file):
    import torch.distributed as dist

    from ._process import spawned_rank

    device = _rank_device(args["device"], rank)
    spawned_rank(rank, world, port, device, lambda: demo_steps(args, rank, world, dist.group.WORLD, device),
                 result_file)


def run(args) -> int:
    a = {k: getattr(args, k) for k in ("tokens", "vocab", "chunk_size", "tp", "device", "seed", "no_memory")}
    env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if env_world > 1:  # launched by torchrun: every rank runs this
        if a["tp"] not in (None, env_world):
            raise DemoError(f"--tp {a['tp']} differs from torchrun's WORLD_SIZE={env_world}; drop --tp")
        return _run_torchrun(a, env_world)
    world = a["tp"] or 1
    dev = _check(a, world)
    if world == 1:
        res = demo_steps(a, 0, 1, None, _rank_device(dev, 0))
    else:
        import torch.multiprocessing as mp

        from ._process import free_port

        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "result.json")
            mp.spawn(_spawned_rank, args=(world, free_port(), a, out), nprocs=world)
            with open(out) as f:
                res = json.load(f)
    if not a["no_memory"]:
        memory_table(a, world, "cuda" if dev.startswith("cuda") else "cpu")
    return 0 if res["ok"] else 1


def _run_torchrun(a, world) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    try:
        dev = _check(a, world)
    except DemoError as e:
        if rank == 0:
            raise
        raise SystemExit(2) from e
    device = _rank_device(dev, local)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        res = demo_steps(a, rank, world, dist.group.WORLD, device)
        if rank == 0 and not a["no_memory"]:
            memory_table(a, world, "cuda" if dev.startswith("cuda") else "cpu")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if res["ok"] else 1
