"""A/B of the bits: the SHA-256 of every output and gradient of ~330 calls (and 70 a rank under TP 2 over gloo),
for a refactoring that must change no value (issue 46: the chunk loop once).

Run it on the tree before and on the tree after, each under its own package, and compare the two files::

    TRITON_INTERPRET=1 PYTHONPATH=<before> python benchmarks/ab_bits.py before.json
    PYTHONPATH=<before> python benchmarks/ab_bits.py before_tp.json --tp      # from <before>: its tests.helpers
    ... the same for <after> ...
    python benchmarks/ab_bits.py --compare before.json after.json

The calls: the fused head and the logits path (eager, compile and, with ``TRITON_INTERPRET=1``, the Triton
kernels through the interpreter; one vocabulary block and several; soft-cap; a float and a per-row temperature;
sampling replay's kept sets (``entropy_of`` full and kept), distillation's ids and top-k, ``rows="kept"``,
``sum_pi_squared``, bf16, the invariant mode), the fused policy loss, and every divergence kind in its
per-token, loss and logits forms (vocabulary blocks of 16 and 64 columns, soft-caps on both heads, a
temperature tensor, ``rows="kept"``). Under ``--tp`` the divergences and the one-head ops (replay, ids, top-k,
the invariant mode) over a vocabulary sharded on two gloo ranks. Random upstream gradients on every output;
large logit offsets (a confident column). A call a tree refuses records its error, compared like a digest.
A CPU run takes about 2 minutes (``--tp``: 1).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys

import torch

import chunked_entropy as ce

N, H, HT, V = 18, 12, 10, 52
BACKENDS = ["eager", "compile"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def digest(ts):
    d = hashlib.sha256()
    for t in ts:
        if t is None:
            d.update(b"none")
            continue
        d.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return d.hexdigest()


def data(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.9).to(dtype)
    w[5] += 30.0  # large offsets, confident rows
    b = torch.randn(V, generator=g) * 0.2
    ht = torch.randn(N, HT, generator=g).to(dtype)
    wt = (torch.randn(V, HT, generator=g) * 0.9).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    mask = torch.rand(N, generator=g) > 0.2
    temp = torch.rand(N, generator=g) + 0.3
    ups = torch.randn(6, N, generator=g)
    ids = torch.randint(0, V, (N, 3), generator=g)
    return dict(h=h, w=w, b=b.to(dtype), ht=ht, wt=wt, labels=labels, mask=mask, temp=temp, ups=ups, ids=ids)


def keep_sets(seed):
    g = torch.Generator().manual_seed(seed + 100)
    sets = [sorted(set(torch.randint(0, V, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()))
            for _ in range(N)]
    ids = torch.tensor([j for s in sets for j in s], dtype=torch.int64)
    offs = torch.tensor([0] + list(itertools.accumulate(len(s) for s in sets)), dtype=torch.int64)
    return ids, offs


def head_case(backend, vcs, softcap, temp, extra, seed=0, dtype=torch.float32, logits=False, group=None, wshard=None,
              tile=None):
    p = data(seed, dtype)
    chunking = ce.Chunking(5, vcs, backend=backend, **({} if tile is None else dict(invariant=True, tile=tile)))
    t = p["temp"] if temp == "tensor" else 0.7
    w0 = p["w"] if wshard is None else p["w"][wshard]
    h, w = p["h"].clone().requires_grad_(), w0.clone().requires_grad_()
    layer = ce.OutputLayer(w, softcap=8.0 if softcap else None, process_group=group)
    kw = {}
    if extra == "keep":
        kw = dict(keep=keep_sets(seed))
    elif extra == "keep_kept":
        kw = dict(keep=keep_sets(seed), entropy_of="kept", compute_sum_pi_squared=True)
    elif extra == "at":
        kw = dict(log_probs_at=p["ids"])
    elif extra == "topk":
        kw = dict(top_k=3)
    elif extra == "rows":
        kw = dict(rows="kept")
    elif extra == "spi":
        kw = dict(compute_sum_pi_squared=True)
    if logits:
        z = (p["h"].float() @ w0.float().t()).to(dtype).detach().requires_grad_()
        out = ce.log_probs_and_entropy(z, p["labels"], layer=ce.OutputLayer(softcap=8.0 if softcap else None,
                                                                            process_group=group),
                                       chunking=chunking, temperature=t, label_mask=p["mask"], **kw)
        leaves = [z]
    else:
        out = ce.linear_log_probs_and_entropy(h, layer, p["labels"], chunking=chunking, temperature=t,
                                              label_mask=p["mask"], **kw)
        leaves = [h, w]
    outs = [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]
    total = sum((o.float() * p["ups"][i].view(-1, *([1] * (o.dim() - 1)))).sum() for i, o in enumerate(outs))
    grads = torch.autograd.grad(total, leaves)
    return digest(outs + list(grads))


def loss_case(backend, vcs, softcap, seed=0, dtype=torch.float32):
    p = data(seed, dtype)
    chunking = ce.Chunking(5, vcs, backend=backend)
    h, w = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    layer = ce.OutputLayer(w, softcap=8.0 if softcap else None)
    old, adv = (p["ups"][0] * 0.3 - 3.0)[None], p["ups"][1][None]
    loss, _ = ce.linear_policy_loss(h[None], layer, p["labels"].clamp_min(0)[None], old, adv, p["mask"][None],
                                    loss=ce.PolicyLoss(entropy_coeff=0.01), chunking=chunking, temperature=0.7)
    grads = torch.autograd.grad(loss * 1.3, [h, w])
    return digest([loss, *grads])


def div_case(form, kind, backend, vcs, softcap, temp, seed=0, rows=None, group=None, wshard=None):
    p = data(seed)
    div = ce.Divergence(kind, 0.3 if kind == "jsd" else None)
    chunking = ce.Chunking(5, vcs, backend=backend)
    t = p["temp"] if temp == "tensor" else 0.8
    w, b, wt = p["w"], p["b"], p["wt"]
    if wshard is not None:
        w, b, wt = w[wshard], b[wshard], wt[wshard]
    hs, ws, bs = p["h"].clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    sl = ce.OutputLayer(ws, bs, softcap=6.0 if softcap else None, process_group=group)
    tl = ce.OutputLayer(wt, softcap=9.0 if softcap else None, process_group=group)
    kw = {} if rows is None else dict(rows=rows)
    if form == "head":
        out = ce.linear_divergence(hs, sl, p["ht"], tl, divergence=div, chunking=chunking, labels=p["labels"],
                                   temperature=t, label_mask=p["mask"], compute_entropy=True, **kw)
        outs = list(out)
        total = sum((o * p["ups"][i]).sum() for i, o in enumerate(outs))
        leaves = [hs, ws, bs]
    elif form == "loss":
        out = ce.linear_divergence_loss(hs, sl, p["ht"], tl, divergence=div, chunking=chunking, temperature=t,
                                        label_mask=p["mask"], compute_entropy=True, weights=p["ups"][5].abs(), **kw)
        outs = list(out)
        total = out.loss * 1.7
        leaves = [hs, ws, bs]
    else:
        zs = (p["h"] @ w.t() + b).detach().requires_grad_()
        zt = (p["ht"] @ wt.t()).detach()
        out = ce.divergence_from_logits(zs, zt, divergence=div, chunking=chunking, labels=p["labels"], temperature=t,
                                        label_mask=p["mask"], compute_entropy=True,
                                        student_layer=ce.OutputLayer(softcap=6.0 if softcap else None,
                                                                     process_group=group),
                                        teacher_layer=ce.OutputLayer(softcap=9.0 if softcap else None,
                                                                     process_group=group), **kw)
        outs = list(out)
        total = sum((o * p["ups"][i]).sum() for i, o in enumerate(outs))
        leaves = [zs]
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return digest(outs + list(grads))


def cases():
    out = {}
    for be in BACKENDS:
        for vcs in (None, 16):
            for sc in (False, True):
                for temp in ("float", "tensor"):
                    out[f"head/{be}/{vcs}/{sc}/{temp}"] = lambda be=be, vcs=vcs, sc=sc, temp=temp: head_case(
                        be, vcs, sc, temp, None)
                out[f"logits/{be}/{vcs}/{sc}"] = lambda be=be, vcs=vcs, sc=sc: head_case(be, vcs, sc, "tensor", None,
                                                                                          logits=True)
                out[f"loss/{be}/{vcs}/{sc}"] = lambda be=be, vcs=vcs, sc=sc: loss_case(be, vcs, sc)
            for extra in ("keep", "keep_kept", "at", "topk", "rows", "spi"):
                out[f"head/{be}/{vcs}/{extra}"] = lambda be=be, vcs=vcs, extra=extra: head_case(be, vcs, True, "tensor",
                                                                                               extra)
                if extra in ("keep", "at"):
                    out[f"logits/{be}/{vcs}/{extra}"] = lambda be=be, vcs=vcs, extra=extra: head_case(
                        be, vcs, False, "tensor", extra, logits=True)
            out[f"head/{be}/{vcs}/bf16"] = lambda be=be, vcs=vcs: head_case(be, vcs, True, "float", None,
                                                                            dtype=torch.bfloat16)
            out[f"loss/{be}/{vcs}/bf16"] = lambda be=be, vcs=vcs: loss_case(be, vcs, False, dtype=torch.bfloat16)
        if be != "triton":
            for logits in (False, True):
                out[f"inv/{be}/{logits}"] = lambda be=be, logits=logits: head_case(be, None, True, "tensor", None,
                                                                                   logits=logits, tile=52)
        for form in ("head", "loss", "logits"):
            for kind in ("forward_kl", "reverse_kl", "jsd"):
                for vcs in (None, 16, 64):
                    for sc in (False, True):
                        out[f"div/{form}/{kind}/{be}/{vcs}/{sc}"] = (
                            lambda form=form, kind=kind, be=be, vcs=vcs, sc=sc: div_case(form, kind, be, vcs, sc,
                                                                                      "tensor"))
                out[f"div/{form}/{kind}/{be}/None/float"] = (
                    lambda form=form, kind=kind, be=be: div_case(form, kind, be, None, True, "float"))
                if form != "logits":  # rows="kept" is for the ops over hidden states
                    out[f"div/{form}/{kind}/{be}/16/rows"] = (
                        lambda form=form, kind=kind, be=be: div_case(form, kind, be, 16, True, "tensor", rows="kept"))
    return out


def _tp(rank, world, path):
    import torch.distributed as dist
    group = dist.group.WORLD
    per = V // world
    sl = slice(rank * per, (rank + 1) * per)
    res = {}
    for be in ("eager", "compile"):
        for form in ("head", "loss", "logits"):
            for kind in ("forward_kl", "reverse_kl", "jsd"):
                for vcs in (None, 8):
                    res[f"tp/{form}/{kind}/{be}/{vcs}"] = div_case(form, kind, be, vcs, True, "tensor", group=group,
                                                                   wshard=sl)
    for be in ("eager", "compile"):
        for vcs in (None, 8):
            for logits in (False, True):
                for extra in (None, "keep", "at", "topk"):
                    res[f"tp/h/{be}/{vcs}/{logits}/{extra}"] = head_case(be, vcs, True, "tensor", extra, logits=logits,
                                                                         group=group, wshard=sl)
        res[f"tp/inv/{be}"] = head_case(be, None, True, "tensor", None, group=group, wshard=sl, tile=per // 2)
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump(res, f)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    differ = sorted(k for k in a if a[k] != b.get(k))
    extra = sorted(k for k in b if k not in a)
    print(f"{len(a)} calls: {len(differ)} differ{': ' + ', '.join(differ[:20]) if differ else ''}"
          f"{'; only in ' + b_path + ': ' + ', '.join(extra[:20]) if extra else ''}")
    return 1 if differ or extra else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    path = sys.argv[1]
    if "--tp" in sys.argv:
        sys.path.insert(0, os.getcwd())
        from tests.helpers import run_distributed
        run_distributed(_tp, 2, path)
        res = {}
        for r in range(2):
            with open(f"{path}.rank{r}") as f:
                for k, v in json.load(f).items():
                    res[f"{k}/rank{r}"] = v
    else:
        only = os.environ.get("ONLY")
        res = {}
        for k, fn in cases().items():
            if only and only not in k:
                continue
            try:
                res[k] = fn()
            except Exception as e:  # noqa: BLE001 - a refusal is a result too, compared as one
                res[k] = f"error {type(e).__name__}: {e}"[:200]
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(len(res), "calls,", sum(1 for v in res.values() if v.startswith("error")), "refused")
