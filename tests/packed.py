"""Packed sequences as slime and Miles lay them out, and the float64 reference of their log-probs.

A batch of samples (prompt + response) is packed into one ``[T, V]`` sequence;
logits row ``p`` of a sample predicts its token ``p + 1``. Under context
parallelism each rank holds either its two zigzag chunks of every sample
(each padded to ``2 * cp`` chunks) or, with ``--allgather-cp``, a contiguous
``1 / cp`` of the whole sequence. Written from the frameworks' code, for the
tests of their plugins.
"""

from __future__ import annotations

import math

import torch

V_LOCAL = 13


def samples(seed, v, n_samples=3):
    """Packed samples: tokens, total and response lengths, top-p sets, logits of every position, upstreams."""
    g = torch.Generator().manual_seed(seed)
    totals = [9, 7, 12][:n_samples]
    resps = [5, 3, 8][:n_samples]
    tokens = [torch.randint(0, v, (t,), generator=g) for t in totals]
    logits = [torch.randn(t, v, generator=g, dtype=torch.float64) * 2 for t in totals]
    ids, offsets = [], []
    for s, r in enumerate(resps):
        sets = []
        for j in range(r):
            row = logits[s][totals[s] - r - 1 + j]
            kind = (s + j) % 4
            if kind == 0:  # top-k-like
                sets.append(torch.argsort(row, descending=True)[:3].tolist())
            elif kind == 1:  # an empty recorded set: slime keeps only the sampled token
                sets.append([])
            elif kind == 2:  # arbitrary, without the row's maximum
                sets.append([k for k in range(0, v, 5) if k != int(row.argmax())])
            else:  # the sampled token not recorded
                nxt = int(tokens[s][totals[s] - r + j])
                sets.append([k for k in torch.argsort(row, descending=True)[:4].tolist() if k != nxt])
        if s == 2:  # fewer offsets than response tokens: the last rows keep the whole vocabulary
            sets = sets[:-2]
        ids.append([k for st in sets for k in st])
        offsets.append([0] + [sum(len(st) for st in sets[: i + 1]) for i in range(len(sets))])
    ups = [(torch.randn(r, generator=g, dtype=torch.float64), torch.randn(r, generator=g, dtype=torch.float64))
           for r in resps]
    return tokens, totals, resps, ids, offsets, logits, ups


def reference(tokens, totals, resps, ids, offsets, logits, temperature, with_topp):
    """float64 per-sample log-probs and entropies of response tokens, from the definition."""
    out = []
    for s, (toks, total, resp) in enumerate(zip(tokens, totals, resps, strict=True)):
        lps, ents = [], []
        for j in range(resp):
            x = logits[s][total - resp - 1 + j] / temperature
            label = int(toks[total - resp + j])
            keep = torch.ones_like(x, dtype=torch.bool)
            if with_topp and j < len(offsets[s]) - 1:
                keep = torch.zeros_like(keep)
                keep[ids[s][offsets[s][j]:offsets[s][j + 1]]] = True
                keep[label] = True
            lps.append(torch.log_softmax(x.masked_fill(~keep, -math.inf), -1)[label])
            p = torch.softmax(x, -1)
            ents.append(-(p * torch.log_softmax(x, -1)).sum())
        out.append((torch.stack(lps), torch.stack(ents)))
    return out


def local_logits(logits, totals, cp, cp_rank, mode):
    """This CP rank's rows of the packed logits, in slime's layouts; and the global position of each row."""
    if cp == 1 or mode == "allgather":
        full = torch.cat(logits)
        pad = (-full.shape[0]) % cp
        full = torch.cat([full, full.new_zeros(pad, full.shape[1])])
        t = full.shape[0] // cp
        return full[cp_rank * t:(cp_rank + 1) * t]
    parts = []
    for lg, total in zip(logits, totals, strict=True):  # zigzag: each sample padded to 2 * cp chunks
        chunk = (total + 2 * cp - 1) // (2 * cp)
        padded = torch.cat([lg, lg.new_zeros(2 * cp * chunk - total, lg.shape[1])])
        parts += [padded[cp_rank * chunk:(cp_rank + 1) * chunk],
                  padded[(2 * cp - cp_rank - 1) * chunk:(2 * cp - cp_rank) * chunk]]
    return torch.cat(parts)


def zigzag_of(values, total, resp, cp, cp_rank):
    """A response's values in slime's zigzag layout for this CP rank (its two halves)."""
    if cp == 1:
        return values
    chunk = (total + 2 * cp - 1) // (2 * cp)
    first = total - resp - 1
    halves = []
    spans = ((cp_rank * chunk, (cp_rank + 1) * chunk), ((2 * cp - cp_rank - 1) * chunk, (2 * cp - cp_rank) * chunk))
    for c0, c1 in spans:
        lo, hi = max(c0, first), min(c1, total - 1)
        if lo < hi:
            halves.append(values[lo - first:hi - first])
    return torch.cat(halves) if halves else values[:0]
