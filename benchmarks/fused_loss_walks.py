"""The fused policy loss's two walks, timed in one process: three GEMM passes against four.

``linear_policy_loss`` (vanilla PPO, entropy bonus 0.01) forward + backward on bf16 (or another dtype's)
weights, at ``Chunking(max_working_bytes=...)`` large enough for the three-pass walk's float32 accumulator
and at 1 byte (four passes). The two alternate, one call each per round, after a warm-up of each; the
median of ``--rounds`` per walk and their ratio are printed. Same inputs, same process:

    python benchmarks/fused_loss_walks.py --dtype bfloat16 --tokens 2048 --hidden 512 --vocab 16384 --chunk 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from chunked_entropy import Chunking, PolicyLoss, linear_policy_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, a.tokens, a.hidden, generator=g).to(dev, dtype)
    weight = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden**0.5).to(dev, dtype)
    labels = torch.randint(0, a.vocab, (1, a.tokens), generator=g).to(dev)
    old, adv = torch.full((1, a.tokens), -9.0, device=dev), torch.randn(1, a.tokens, generator=g).to(dev)
    mask = torch.ones(1, a.tokens, dtype=torch.bool, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(budget: int) -> float:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        sync()
        t0 = time.perf_counter()
        loss, _ = linear_policy_loss(h, w, labels, old, adv, mask, loss=PolicyLoss(entropy_coeff=0.01),
                                     chunking=Chunking(a.chunk, max_working_bytes=budget))
        loss.backward()
        sync()
        return time.perf_counter() - t0

    walks = {"3 GEMM passes": 1 << 40, "4 GEMM passes": 1}
    for budget in walks.values():
        step(budget)
    times = {name: [] for name in walks}
    for r in range(a.rounds):
        for name in (list(walks) if r % 2 == 0 else list(walks)[::-1]):
            times[name].append(step(walks[name]))
    print(f"linear_policy_loss, {a.dtype}, tokens={a.tokens} H={a.hidden} V={a.vocab} chunk={a.chunk}, "
          f"{a.device} ({torch.get_num_threads()} threads), median of {a.rounds} alternating rounds:")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name}: {med[name]:.3f} s ({min(t):.3f}-{max(t):.3f})")
    print(f"  four / three: {med['4 GEMM passes'] / med['3 GEMM passes']:.2f}x")


if __name__ == "__main__":
    main()
