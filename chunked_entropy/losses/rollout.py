"""Rollout correction: importance-sampling weights and rejection masks for the rollout-training mismatch.

verl 0.9.1's ``compute_rollout_correction_and_rejection_mask``
(``verl/trainer/ppo/rollout_corr_helper.py``) as :func:`rollout_correction`:
from the training policy's log-probs and the rollout engine's, truncated
(TIS) or windowed (IcePop) IS weights per token or per sequence, rejection
masks from token- and sequence-level divergences, and verl's diagnostics, with
verl's metric names. The weights are what every objective's
``rollout_is_weights`` takes; the mask replaces the response mask. Nothing
here is differentiated (verl computes it under ``no_grad``), and the metrics
stay 0-dim tensors (no host sync), where verl returns floats.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .._checks import checked_call, is_finite_real, is_int, is_real, require, value_repr
from ._common import check_mask, check_same_shape, check_tensor

#: verl's bound on log-ratios before ``exp`` (``SAFETY_BOUND``).
SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""Rejection criteria of ``rollout_rs`` (comma separated to combine them)."""


# ----------------------------------------------------------------------------- verl's masked means (+1e-8)


def _sum(v, m, dim=None):
    picked = torch.where(m.bool(), v, torch.zeros((), dtype=v.dtype, device=v.device)) * m
    return picked.sum() if dim is None else picked.sum(dim=dim)


def _mean(v, m, dim=None):
    """verl's ``masked_mean``: the count gets ``+1e-8`` (kept, so that every metric equals verl's)."""
    return _sum(v, m, dim) / ((m.sum() if dim is None else m.sum(dim=dim)) + 1e-8)


# ----------------------------------------------------------------------------- thresholds


def parse_is_threshold(spec) -> tuple[float, Optional[float]]:
    """``rollout_is_threshold``: a number (TIS: the upper bound) or ``"lower_upper"`` (IcePop)."""
    if isinstance(spec, bool) or not (is_real(spec) or isinstance(spec, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    if isinstance(spec, str):
        parts = spec.strip().split("_", 1)
        try:
            values = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is not a number or 'lower_upper'") from None
        lower, upper = (None, values[0]) if len(values) == 1 else values
    else:
        if is_int(spec) and not is_finite_real(spec):  # no float holds it: named, not float()'s OverflowError
            raise ValueError(f"rollout_is_threshold must be a number a float holds, got {value_repr(spec)}")
        upper = float(spec)
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold needs 0 < lower <= upper, got {spec!r}")
    return upper, lower


def parse_rs(rollout_rs: str, threshold) -> list[tuple[str, Optional[float], float]]:
    """``[(option, lower, upper)]`` of ``rollout_rs`` and ``rollout_rs_threshold`` (one value shared, or one
    per option; k1 options take ``"lower_upper"`` ratio bounds, defaulting the lower to ``1 / upper``)."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError(f"rollout_rs must name at least one criterion of {RS_OPTIONS}, got {rollout_rs!r}")
    for o in options:
        if o not in RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown criterion {o!r}; expected some of {RS_OPTIONS}")
    if threshold is None or isinstance(threshold, bool):
        raise ValueError("rollout_rs_threshold must be given (a number or a string) when rollout_rs is set")
    specs = [str(threshold)] if is_real(threshold) else [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs one value or {len(options)} (one per rollout_rs criterion), "
                         f"got {threshold!r}")
    specs = specs * len(options) if len(specs) == 1 else specs
    out = []
    for o, spec in zip(options, specs, strict=True):
        try:
            if o.endswith("k1"):
                lo, hi = (spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec))
                lower, upper = float(lo), float(hi)
            elif "_" in spec:
                raise ValueError(f"rollout_rs_threshold for {o!r} takes one upper bound, got {spec!r}")
            else:
                lower, upper = None, float(spec)
        except ValueError as e:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {o!r}: {e}") from None
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold for {o!r} needs 0 < lower <= upper, got {spec!r}")
        out.append((o, lower, upper))
    return out


# ----------------------------------------------------------------------------- IS weights


def _is_weights(log_ratio, mask, level, threshold, batch_normalize, group):
    upper, lower = parse_is_threshold(threshold)
    if level == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = _sum(log_ratio, mask, -1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_for_metrics, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(w, raw, log_for_metrics, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper)).to(raw.dtype), mask)
    if batch_normalize:
        if level == "token":
            values, m = w, mask.to(w.dtype)
        else:
            values, m = _mean(w, mask, -1), (mask.sum(dim=-1) > 0).to(w.dtype)
        if group is not None:  # verl's distributed_masked_mean over the group
            pair = torch.stack([(values * m).sum(), m.sum()])
            dist.all_reduce(pair, group=group)
            mean = pair[0] / pair[1]
        else:
            mean = _mean(w, mask) if level == "token" else (values * m).sum() / m.sum().clamp_min(1e-8)
        big = mean > 1e-8
        factor = torch.where(big, mean, torch.ones_like(mean))
        w = w / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return w, metrics


def _is_metrics(w, raw, log_for_metrics, mask, level, upper, lower):
    low = 1.0 / upper if lower is None else lower
    b = mask.bool()
    out = {}
    if level == "sequence":
        out["rollout_is_max"] = torch.exp(torch.clamp(log_for_metrics.max(), max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(log_for_metrics.min())
        out["rollout_is_mean"] = _mean(w, mask)
        out["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(upper)).to(w.dtype).mean()
        out["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(low)).to(w.dtype).mean()
    else:
        out["rollout_is_mean"] = _mean(w, mask)
        out["rollout_is_ratio_fraction_high"] = _mean((raw > upper).to(w.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = _mean((raw < low).to(w.dtype), mask)
        out["rollout_is_max"] = w.masked_fill(~b, -math.inf).max()
        out["rollout_is_min"] = w.masked_fill(~b, math.inf).min()
    clamped = w.clamp(min=0.0, max=upper)
    mc = _mean(clamped, mask)
    std = torch.sqrt(torch.clamp(_mean(clamped.square(), mask) - mc.square(), min=0.0))
    out["rollout_is_std"] = torch.where(mask.sum() > 1, std, torch.zeros((), dtype=w.dtype, device=w.device))
    normalized = clamped / (_mean(clamped, mask) + 1e-8)
    # 1 / mean(w_n**2); 0 when no token keeps a weight (an IcePop window that zeroes them all), where verl 0.9.1
    # divides by zero (ZeroDivisionError) in Python
    mean_sq = _mean(normalized.square(), mask)
    out["rollout_is_eff_sample_size"] = torch.where(mean_sq > 0, 1.0 / torch.where(mean_sq > 0, mean_sq, 1.0),
                                                    torch.zeros_like(mean_sq))
    if w.dim() > 1:
        seq = _mean(w, mask, -1)
        out["rollout_is_seq_mean"] = seq.mean()
        out["rollout_is_seq_std"] = seq.std() if seq.numel() > 1 else torch.zeros((), dtype=w.dtype, device=w.device)
        out["rollout_is_seq_max"] = seq.max()
        out["rollout_is_seq_min"] = seq.min()
        out["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max()
        raw_seq = _mean(raw, mask, -1)
        out["rollout_is_seq_fraction_high"] = (raw_seq > upper).to(w.dtype).mean()
        out["rollout_is_seq_fraction_low"] = (raw_seq < low).to(w.dtype).mean()
    return out


# ----------------------------------------------------------------------------- rejection


def _seq_max(v, mask):
    m = v.masked_fill(~mask.bool(), -math.inf).max(dim=-1).values
    return torch.where(m == -math.inf, torch.zeros_like(m), m)


def _rejection(log_ratio, mask, rollout_rs, threshold):
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_kind = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    b = mask.bool()
    seq_valid = mask.sum(dim=-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics = {}
    for option, lower, upper in parse_rs(rollout_rs, threshold):
        kind = option[-2:]
        lo_log = math.log(lower) if kind == "k1" else None
        hi = math.log(upper) if kind == "k1" else upper
        token = per_kind[kind]
        if option.startswith("token"):
            stat, seq_stat = token, None
        else:
            seq_stat = (_sum(token, mask, -1) if option.startswith("seq_sum") else
                        _mean(token, mask, -1) if option.startswith("seq_mean") else _seq_max(token, mask))
            stat = seq_stat.unsqueeze(-1).expand_as(mask)
        keep = stat <= hi if lo_log is None else (stat >= lo_log) & (stat <= hi)
        keep = keep if seq_stat is None or keep.shape == mask.shape else keep.expand_as(b)
        metrics.update(_rs_metrics(option, stat, mask, seq_valid, "token" if seq_stat is None else "sequence",
                                   seq_stat, hi, 0.0 if lo_log is None else lo_log, lo_log is not None))
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        seq_keep = (~((~keep) & b)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = _mean(1 - keep_f, mask)
        sv = seq_valid.to(log_ratio.dtype)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            ((1.0 - seq_keep.to(log_ratio.dtype)) * sv).sum() / sv.sum() if sv.sum() > 0
            else torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    metrics["rollout_rs_masked_fraction"] = _mean(1 - combined, mask)
    final = (combined > 0.5) & b
    metrics["rollout_rs_seq_masked_fraction"] = (~final & b).any(dim=-1).to(log_ratio.dtype).mean()
    return (mask * combined).to(mask.dtype), metrics


def _rs_metrics(option, stat, mask, seq_valid, level, seq_values, upper, lower, use_lower):
    p = f"rollout_rs_{option}"
    b = mask.bool()
    seq = seq_values if seq_values is not None else _mean(stat, mask, -1)
    seq_v = seq[seq_valid]
    zero = torch.zeros((), dtype=stat.dtype, device=stat.device)
    out = {f"{p}_mean": _mean(stat, mask)}
    by_seq = level == "sequence" and seq_v.numel() > 0
    out[f"{p}_max"] = seq_v.max() if by_seq else stat.masked_fill(~b, -math.inf).max()
    out[f"{p}_min"] = seq_v.min() if by_seq else stat.masked_fill(~b, math.inf).min()
    if by_seq:
        out[f"{p}_fraction_high"] = (seq_v > upper).to(stat.dtype).mean()
        out[f"{p}_fraction_low"] = (seq_v < lower).to(stat.dtype).mean() if use_lower else zero
    else:
        out[f"{p}_fraction_high"] = _mean((stat > upper).to(stat.dtype), mask)
        out[f"{p}_fraction_low"] = _mean((stat < lower).to(stat.dtype), mask) if use_lower else zero
    if mask.sum() > 1:
        c = stat.clamp(min=lower if use_lower else 0.0, max=upper)
        mc = _mean(c, mask)
        out[f"{p}_std"] = torch.sqrt(torch.clamp(_mean(c.square(), mask) - mc.square(), min=0.0))
    else:
        out[f"{p}_std"] = zero
    if seq_v.numel() > 0:
        out[f"{p}_seq_mean"] = seq_v.mean()
        out[f"{p}_seq_std"] = seq_v.std() if seq_v.numel() > 1 else zero
        out[f"{p}_seq_max"] = seq_v.max()
        out[f"{p}_seq_min"] = seq_v.min()
        out[f"{p}_seq_max_deviation"] = seq_v.abs().max()
        out[f"{p}_seq_fraction_high"] = (seq_v > upper).to(stat.dtype).mean()
        if use_lower:
            out[f"{p}_seq_fraction_low"] = (seq_v < lower).to(stat.dtype).mean()
    else:
        for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                  "seq_fraction_low"):
            out[f"{p}_{k}"] = zero
    return out


# ----------------------------------------------------------------------------- diagnostics


def _offpolicy_metrics(lp, rollout_lp, mask):
    out = {}
    mean_train = _mean(lp, mask, -1)
    out["training_ppl"] = torch.exp(-mean_train).mean()
    out["training_log_ppl"] = (-mean_train).mean()
    out["kl"] = _mean(rollout_lp - lp, mask)
    log_ratio = lp - rollout_lp
    out["k3_kl"] = _mean(torch.exp(log_ratio) - log_ratio - 1, mask)
    mean_roll = _mean(rollout_lp, mask, -1)
    out["rollout_ppl"] = torch.exp(-mean_roll).mean()
    out["rollout_log_ppl"] = (-mean_roll).mean()
    diff = mean_roll - mean_train
    out["log_ppl_diff"] = diff.mean()
    out["log_ppl_abs_diff"] = diff.abs().mean()
    out["log_ppl_diff_max"] = diff.max()
    out["log_ppl_diff_min"] = diff.min()
    out["ppl_ratio"] = torch.exp(diff).mean()
    rho = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    out["chi2_token"] = _mean(rho.square(), mask) - 1.0
    seq = torch.clamp(_sum(log_ratio, mask, -1), -SAFETY_BOUND, SAFETY_BOUND)
    out["chi2_seq"] = torch.exp(2.0 * seq).mean() - 1.0
    return out


def rollout_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold=None,
    group=None,
):
    """IS weights, rejection mask and diagnostics: verl 0.9.1's ``compute_rollout_correction_and_rejection_mask``.

    With ``log r = log_probs - rollout_log_probs`` (the training policy's over
    the rollout engine's, per token):

    - ``rollout_is="token"``: ``w_t = exp(clamp(log r_t, -20, 20))``;
      ``"sequence"``: ``w = exp(clamp(sum_t log r_t, -20, 20))`` for every
      token of the sequence; None: no weights. A number as
      ``rollout_is_threshold`` truncates them there (TIS); ``"lower_upper"``
      zeroes those outside the window (IcePop). ``rollout_is_batch_normalize``
      divides them by their mean (over the tokens, or the sequences), over
      ``group`` when given (verl averages over its default group whenever
      torch.distributed is initialized: pass that group to match it).
    - ``rollout_rs``: comma-separated criteria (:data:`RS_OPTIONS`) from
      the k1, k2 and k3 estimates of the divergence, per token or summed,
      averaged or maximized per sequence; a token (or a whole sequence) that
      fails any of them is masked. ``rollout_rs_threshold`` gives one bound
      for all or one per criterion (k1: ``"lower_upper"`` ratio bounds).

    Args:
        log_probs: ``[B, T]`` the training policy's log-probs (verl's ``old_log_prob``).
        rollout_log_probs: ``[B, T]`` the rollout engine's (e.g. vLLM's bf16).
        response_mask: ``[B, T]`` bool or 0/1, with at least one valid token.
        rollout_is: ``"token"``, ``"sequence"`` or None (verl's ``RolloutCorrectionConfig`` field, as the next).
        rollout_is_threshold: a number (TIS) or ``"lower_upper"`` (IcePop).
        rollout_is_batch_normalize: normalize the weights to mean 1.
        rollout_rs: comma-separated rejection criteria of :data:`RS_OPTIONS`, or None.
        rollout_rs_threshold: their bounds, one for all or one per criterion.
        group: the data-parallel group of the batch normalization, or None.

    Returns:
        ``(weights, mask, metrics)``: ``[B, T]`` detached weights (0 at padding;
        None without ``rollout_is``), the response mask with the rejected
        tokens set to 0 (its dtype), and verl's metrics under verl's
        ``"rollout_corr/..."`` names as 0-dim tensors.

    Raises:
        ValueError / TypeError: shapes, an empty mask, an unknown level or
            criterion, a missing or malformed threshold (named).
    """
    with checked_call():  # the value checks: one host sync on an accelerator, before any work
        check_tensor("log_probs", log_probs)
        check_same_shape("log_probs", log_probs, rollout_log_probs=rollout_log_probs)
        check_mask(response_mask, log_probs, "log_probs", "response_mask")
        check_options(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
        check_not_empty(response_mask)
    return correction(log_probs, rollout_log_probs, response_mask, rollout_is=rollout_is,
                      rollout_is_threshold=rollout_is_threshold, rollout_is_batch_normalize=rollout_is_batch_normalize,
                      rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold, group=group)


def check_options(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold):
    """The correction's settings (see :func:`rollout_correction`), each named where it is wrong."""
    if rollout_is is not None and rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {rollout_is!r}")
    if rollout_is is not None:
        parse_is_threshold(rollout_is_threshold)
    if rollout_rs is not None:
        if not isinstance(rollout_rs, str):
            raise TypeError(f"rollout_rs must be a string of comma-separated criteria, got {rollout_rs!r}")
        parse_rs(rollout_rs, rollout_rs_threshold)
    if not isinstance(rollout_is_batch_normalize, bool):
        raise TypeError(f"rollout_is_batch_normalize must be a bool, got {rollout_is_batch_normalize!r}")


def check_not_empty(response_mask: torch.Tensor, name: str = "response_mask", why: str = "") -> None:
    """verl's correction needs at least one valid token (a value check of the call: see
    :func:`~chunked_entropy._checks.require`)."""
    require((response_mask != 0).any(), why or f"{name} must hold at least one valid token (verl's rollout "
                                              "correction needs one)")


def correction(log_probs, rollout_log_probs, response_mask, *, rollout_is, rollout_is_threshold,
               rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, group=None):
    """:func:`rollout_correction` of checked arguments: no checks, no host sync (``bypass_mode`` runs it
    once per chunk of whole rows in the fused loss)."""
    with torch.no_grad():
        lp, roll = log_probs.detach(), rollout_log_probs.detach()
        log_ratio = lp - roll
        metrics, weights = {}, None
        if rollout_is is not None:
            weights, m = _is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                     rollout_is_batch_normalize, group)
            metrics.update(m)
        mask = response_mask.clone()
        if rollout_rs is not None and log_ratio.shape[0] > 0:
            mask, m = _rejection(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
            metrics.update(m)
        metrics.update(_offpolicy_metrics(lp, roll, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
