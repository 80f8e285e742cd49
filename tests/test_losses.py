"""chunked_entropy.losses against float64 hand computations (plain Python loops) and hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from chunked_entropy import PolicyLoss, losses
from chunked_entropy.losses import AGG_MODES, agg_loss, entropy_bonus, kl_penalty, policy_loss

MODES = losses.AGG_MODES


def _rand(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def _mask(shape, seed, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < 0.6
    m[0, 0] = True  # at least one valid token
    if empty_row:
        m[-1] = False  # one fully masked sequence
    return m


# ------------------------------------------------------------ reference by hand (Python floats)


def _agg_by_hand(loss, mask, mode, scale=None):
    """The documented formula, element by element in Python floats; and dL/dloss as nested lists."""
    rows = [[float(x) for x in r] for r in loss.detach()]
    ms = [[bool(x) for x in r] for r in mask]
    t = len(rows[0])
    n = [sum(r) for r in ms]
    sums = [sum(x for x, m in zip(r, mr, strict=True) if m) for r, mr in zip(rows, ms, strict=True)]
    nonempty = [i for i in range(len(rows)) if n[i] > 0]
    total = sum(n)
    grad = [[0.0] * t for _ in rows]
    if mode == "token-mean":
        value = sum(sums) / total
        for i in range(len(rows)):
            for j in range(t):
                grad[i][j] = (1.0 / total) if ms[i][j] else 0.0
    elif mode == "seq-mean-token-sum":
        value = sum(sums[i] for i in nonempty) / len(nonempty)
        for i in nonempty:
            for j in range(t):
                grad[i][j] = (1.0 / len(nonempty)) if ms[i][j] else 0.0
    elif mode == "seq-mean-token-mean":
        value = sum(sums[i] / n[i] for i in nonempty) / len(nonempty)
        for i in nonempty:
            for j in range(t):
                grad[i][j] = (1.0 / (n[i] * len(nonempty))) if ms[i][j] else 0.0
    elif mode == "token-sum":
        value = sum(sums)
        for i in range(len(rows)):
            for j in range(t):
                grad[i][j] = 1.0 if ms[i][j] else 0.0
    else:  # seq-mean-token-sum-norm: the sequence mean of the sums, over T (or the scale)
        d = (t if scale is None else scale) * len(nonempty)
        value = sum(sums[i] for i in nonempty) / d
        for i in nonempty:
            for j in range(t):
                grad[i][j] = (1.0 / d) if ms[i][j] else 0.0
    return value, grad


# ------------------------------------------------------------ agg_loss


def test_agg_loss_hand_worked_numbers():
    loss = torch.tensor([[1.0, 2.0, math.inf], [4.0, math.nan, 6.0], [7.0, 8.0, math.nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # valid: row0 {1, 2}, row1 {4}, row2 nothing; inf/nan sit only on masked positions
    expected = {
        "token-mean": (1 + 2 + 4) / 3,
        "seq-mean-token-sum": (3 + 4) / 2,  # the empty row does not count
        "seq-mean-token-mean": (1.5 + 4) / 2,
        "seq-mean-token-sum-norm": (3 + 4) / 2 / 3,  # verl 0.9.1: the sequence mean, over loss_mask.shape[-1]
        "token-sum": 1 + 2 + 4,
    }
    for mode, want in expected.items():
        x = loss.clone().requires_grad_(True)
        got = agg_loss(x, mask, mode)
        assert got.dtype == torch.float64 and got.shape == ()
        assert got.item() == pytest.approx(want, rel=1e-15), mode
        got.backward()
        assert torch.isfinite(x.grad).all(), mode
        assert (x.grad[~mask] == 0).all(), mode
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)
    # the same numbers with a 0/1 float mask
    assert agg_loss(loss, mask.double(), "seq-mean-token-mean").item() == pytest.approx(2.75)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_agg_loss_matches_hand_loop_values_and_grads(mode, dtype):
    loss64 = _rand((5, 7), 1)
    mask = _mask((5, 7), 2)
    x = loss64.to(dtype, copy=True).requires_grad_(True)
    got = agg_loss(x, mask, mode)
    want, want_grad = _agg_by_hand(loss64.to(dtype), mask, mode)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6  # float32 sum of a few dozen terms
    assert got.dtype == dtype
    assert got.item() == pytest.approx(want, rel=rtol, abs=rtol)
    gout = 0.7  # a non-unit upstream gradient
    (got * gout).backward()
    torch.testing.assert_close(x.grad.double(), torch.tensor(want_grad, dtype=torch.float64) * gout, rtol=rtol, atol=0)


def test_agg_loss_scale_factor_and_empty_mask():
    loss64, mask = _rand((3, 4), 3), _mask((3, 4), 4)
    want, _ = _agg_by_hand(loss64, mask, "seq-mean-token-sum-norm", scale=16)
    got = agg_loss(loss64, mask, "seq-mean-token-sum-norm", loss_scale_factor=16)
    assert got.item() == pytest.approx(want, rel=1e-12)
    # nothing selected: 0 with a zero gradient, never NaN
    for mode in MODES:
        x = loss64.clone().requires_grad_(True)
        out = agg_loss(x, torch.zeros(3, 4, dtype=torch.bool), mode)
        out.backward()
        assert out.item() == 0.0 and (x.grad == 0).all(), mode


def test_agg_loss_accepts_leading_dims_as_sequences():
    loss64, mask = _rand((2, 3, 5), 5), _mask((2, 3, 5), 6)
    for mode in MODES:
        got = agg_loss(loss64, mask, mode)
        want, _ = _agg_by_hand(loss64.reshape(6, 5), mask.reshape(6, 5), mode)
        assert got.item() == pytest.approx(want, rel=1e-12), mode


# ------------------------------------------------------------ policy_loss


def _policy_by_hand(lp, old, adv, mask, low, high, c, mode):
    """Per token, in Python floats: the loss term, which branch is taken, and dloss_t/dlog_prob."""
    terms, dterm, clip, lower, kl = [], [], [], [], []
    for i in range(lp.shape[0]):
        tr, dr, cr, lr, kr = [], [], [], [], []
        for j in range(lp.shape[1]):
            a = float(adv[i, j])
            d = float(lp[i, j]) - float(old[i, j])
            dc = min(max(d, -20.0), 20.0)
            r = math.exp(dc)
            dr_dlp = r if -20.0 < d < 20.0 else 0.0
            l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
            if l1 >= l2:
                term, dterm_ = l1, -a * dr_dlp
            else:  # the clipped term: constant in log_prob
                term, dterm_ = l2, 0.0
            binds = False
            if c is not None and a < 0 and term > -a * c:
                term, dterm_, binds = -a * c, 0.0, True
            tr.append(term), dr.append(dterm_), cr.append(float(l2 > l1)), lr.append(float(binds)), kr.append(-dc)
        terms.append(tr), dterm.append(dr), clip.append(cr), lower.append(lr), kl.append(kr)
    value, dagg = _agg_by_hand(torch.tensor(terms, dtype=torch.float64), mask, mode)
    grad = [[dagg[i][j] * dterm[i][j] for j in range(lp.shape[1])] for i in range(lp.shape[0])]
    metrics = {
        "actor/pg_clipfrac": _agg_by_hand(torch.tensor(clip, dtype=torch.float64), mask, "token-mean")[0],
        "actor/pg_clipfrac_lower": _agg_by_hand(torch.tensor(lower, dtype=torch.float64), mask, "token-mean")[0],
        "actor/ppo_kl": _agg_by_hand(torch.tensor(kl, dtype=torch.float64), mask, "token-mean")[0],
    }
    return value, grad, metrics


def test_policy_loss_hand_worked_numbers():
    # tokens: (A, ratio) = (+1, 1.5) clipped at 1.2; (-1, 0.5) clipped at 0.8;
    # (-1, 5) unclipped, dual clip binds at c=3; (+2, 1) unclipped; a masked token.
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0, 100.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -3.0, -0.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    lp0 = old + ratio.log()
    ppo_kl = -(math.log(1.5) + math.log(0.5) + math.log(5.0) + 0.0) / 4
    cases = {
        # c: (loss, d loss / d log_probs, clipfrac_lower)
        3.0: ((-1.2 + 0.8 + 3.0 - 2.0) / 4, [0.0, 0.0, 0.0, -2.0 / 4, 0.0], 1 / 4),
        None: ((-1.2 + 0.8 + 5.0 - 2.0) / 4, [0.0, 0.0, 5.0 / 4, -2.0 / 4, 0.0], 0.0),
    }
    for c, (want, want_grad, want_lower) in cases.items():
        lp = lp0.clone().requires_grad_(True)
        loss, metrics = policy_loss(lp, old, adv, mask, PolicyLoss(options={"clip_ratio_c": c}))
        assert loss.item() == pytest.approx(want, rel=1e-12)
        loss.backward()
        torch.testing.assert_close(lp.grad, torch.tensor([want_grad], dtype=torch.float64), rtol=1e-12, atol=1e-15)
        assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 4)
        assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(want_lower)
        assert metrics["actor/ppo_kl"].item() == pytest.approx(ppo_kl, rel=1e-12)
        for v in metrics.values():
            assert isinstance(v, torch.Tensor) and v.shape == () and v.is_floating_point() and not v.requires_grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "low,high,c",
    [(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.1, 0.5, 1.5)],
)
def test_policy_loss_matches_hand_loop(mode, low, high, c):
    shape = (4, 9)
    old = _rand(shape, 10) - 2.0
    # log-ratios spread over [-1.5, 1.5], plus two beyond verl's +-20 clamp
    delta = 1.5 * torch.tanh(_rand(shape, 11))
    delta[0, 1], delta[1, 2] = 25.0, -25.0
    lp64 = old + delta
    adv = _rand(shape, 12)
    adv[0, 1], adv[1, 2] = -0.7, 0.9  # a huge ratio with A < 0: the dual clip binds
    mask = _mask(shape, 13)
    mask[0, 1] = mask[1, 2] = True
    want, want_grad, want_metrics = _policy_by_hand(lp64, old, adv, mask, low, high, c, mode)
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        lp = lp64.to(dtype, copy=True).requires_grad_(True)
        loss, metrics = policy_loss(
            lp, old.to(dtype), adv.to(dtype), mask,
            PolicyLoss(options={"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c}, aggregation=mode),
        )
        assert loss.dtype == dtype
        assert loss.item() == pytest.approx(want, rel=rtol, abs=rtol)
        (2.5 * loss).backward()
        want_g = 2.5 * torch.tensor(want_grad, dtype=torch.float64)
        torch.testing.assert_close(lp.grad.double(), want_g, rtol=rtol, atol=rtol * 1e-2)
        for k, v in want_metrics.items():
            assert metrics[k].item() == pytest.approx(v, rel=rtol, abs=rtol), k
    # the branches the data must exercise, or this test proves little
    assert want_metrics["actor/pg_clipfrac"] > 0
    if c is not None:
        assert want_metrics["actor/pg_clipfrac_lower"] > 0


def test_policy_loss_grads_for_every_input_and_no_writes():
    shape = (3, 5)
    lp, old, adv = _rand(shape, 20), _rand(shape, 21), _rand(shape, 22)
    mask = _mask(shape, 23, empty_row=False)
    snapshot = [t.clone() for t in (lp, old, adv, mask)]
    inputs = [t.clone().requires_grad_(True) for t in (lp, old, adv)]
    # gradcheck away from the kinks: only smooth pieces are compared
    torch.autograd.gradcheck(
        lambda a, b, c: policy_loss(a, b, c, mask, PolicyLoss(options={"clip_ratio_c": 3.0},
                                                             aggregation="seq-mean-token-mean"))[0],
        inputs,
    )
    policy_loss(lp, old, adv, mask, PolicyLoss(options={"clip_ratio_c": 3.0}))
    for before, after in zip(snapshot, (lp, old, adv, mask), strict=True):
        assert torch.equal(before, after)


# ------------------------------------------------------------ kl_penalty and entropy_bonus


def test_kl_penalty_hand_worked_numbers():
    lp = torch.tensor([-1.0, -2.0, -31.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-2.0, -1.0, -1.0, -31.0], dtype=torch.float64)
    # d = lp - ref = [1, -1, -30, 30]
    e = math.e
    want = {
        "k1": [1.0, -1.0, -30.0, 30.0],
        "abs": [1.0, 1.0, 30.0, 30.0],
        "k2": [0.5, 0.5, 450.0, 450.0],
        # exp(-d) + d - 1; -d clamped to [-20, 20], result to [-10, 10]
        "k3": [1 / e, e - 2, 10.0, 10.0],
    }
    want["kl"], want["mse"], want["low_var_kl"] = want["k1"], want["k2"], want["k3"]
    for kind, values in want.items():
        got = kl_penalty(lp, ref, kind)
        torch.testing.assert_close(got, torch.tensor(values, dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_penalty_values_and_grads_by_hand(kind):
    lp64, ref64 = _rand((6, 5), 30), _rand((6, 5), 31)
    lp64[0, 0], ref64[0, 0] = 0.0, 30.0  # inside k3's log-ratio clamp region
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        lp, ref = lp64.to(dtype, copy=True).requires_grad_(True), ref64.to(dtype, copy=True).requires_grad_(True)
        got = kl_penalty(lp, ref, kind)
        gout = _rand((6, 5), 32)
        (got * gout.to(dtype)).sum().backward()
        val, dlp = [], []
        for x, y in zip(lp64.flatten().tolist(), ref64.flatten().tolist(), strict=True):
            d = x - y
            base = kind.rstrip("+")
            if base in ("k1", "kl"):
                v, g = d, 1.0
            elif base == "abs":
                v, g = abs(d), math.copysign(1.0, d)
            elif base in ("k2", "mse"):
                v, g = 0.5 * d * d, d
            else:
                neg = -d
                if neg > 20.0 or neg < -20.0:
                    v, g = math.exp(min(max(neg, -20.0), 20.0)) - min(max(neg, -20.0), 20.0) - 1.0, 0.0
                else:
                    v, g = math.exp(neg) - neg - 1.0, 1.0 - math.exp(neg)
                if v > 10.0:
                    v, g = 10.0, 0.0
            if kind.endswith("+"):  # straight through: the value above, k2's gradient (unclamped)
                g = d
            val.append(v), dlp.append(g)
        want = torch.tensor(val, dtype=torch.float64).view(6, 5)
        want_dlp = torch.tensor(dlp, dtype=torch.float64).view(6, 5) * gout
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol)
        torch.testing.assert_close(lp.grad.double(), want_dlp, rtol=rtol, atol=rtol)
        torch.testing.assert_close(ref.grad.double(), -want_dlp, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("mode", MODES)
def test_entropy_bonus_is_aggregated_entropy(mode):
    ent64 = _rand((4, 6), 40).abs()
    mask = _mask((4, 6), 41)
    ent = ent64.float().requires_grad_(True)
    got = entropy_bonus(ent, mask, mode)
    want, want_grad = _agg_by_hand(ent64.float(), mask, mode)
    assert got.item() == pytest.approx(want, rel=2e-6)
    (-0.01 * got).backward()  # as in loss = pg_loss - entropy_coeff * bonus
    want_g = -0.01 * torch.tensor(want_grad, dtype=torch.float64)
    torch.testing.assert_close(ent.grad.double(), want_g, rtol=2e-6, atol=0)
    # hand-worked: entropies 1, 3 | 2 with a two-token and a one-token sequence
    e = torch.tensor([[1.0, 3.0], [2.0, 9.0]])
    m = torch.tensor([[True, True], [True, False]])
    hand = {"token-mean": 2.0, "seq-mean-token-sum": 3.0, "seq-mean-token-mean": 2.0,
            "seq-mean-token-sum-norm": 1.5, "token-sum": 6.0}
    assert entropy_bonus(e, m, mode).item() == pytest.approx(hand[mode])


# ------------------------------------------------------------ bad input


def test_bad_input_names_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mode"):
        agg_loss(x, m, "token-max")
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(x, m[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(TypeError, match="loss_mat"):
        agg_loss([[0.0]], m, "token-mean")
    with pytest.raises(TypeError, match="loss_mat"):
        agg_loss(torch.zeros(2, 3, dtype=torch.long), m, "token-mean")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(x, x, x, m, PolicyLoss(aggregation="seq-sum"))
    with pytest.raises(ValueError, match="old_log_probs"):
        policy_loss(x, x[:1], x, m)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x[:, 0], m)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(x, x, x, m.t())
    for c in (1.0, 0.5, -3.0, True, "3"):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            policy_loss(x, x, x, m, PolicyLoss(options={"clip_ratio_c": c}))
    with pytest.raises(ValueError, match="clip_ratio_low"):
        policy_loss(x, x, x, m, PolicyLoss(options={"clip_ratio_low": 1.5}))
    with pytest.raises(ValueError, match="clip_ratio_high"):
        policy_loss(x, x, x, m, PolicyLoss(options={"clip_ratio_high": -0.1}))
    for kind in ("full", "k4", None):
        with pytest.raises(ValueError, match="kind"):
            kl_penalty(x, x, kind)
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_penalty(x, x[:, :1], "k3")
    with pytest.raises(ValueError, match="mode"):
        entropy_bonus(x, m, "mean")
    with pytest.raises(ValueError, match="loss_mask"):
        entropy_bonus(x, m[:1], "token-mean")


def test_docs_page_example_runs(monkeypatch, tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "losses.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks, "docs/losses.md lost its example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/losses.md", "exec"), {"__name__": "__main__"})


# ----------------------------------------------------------------- defects found by fuzzing


def test_nan_at_a_masked_position_gives_no_nan_gradient():
    """A NaN advantage (or log-prob) of padding must not reach any gradient through 0 * NaN."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, float("nan"), -0.4]])
    adv = torch.tensor([[0.5, float("nan"), -1.0]])
    mask = torch.tensor([[True, False, True]])
    for mode in AGG_MODES:
        lp.grad = None
        loss, metrics = policy_loss(lp, old, adv, mask, PolicyLoss(options={"clip_ratio_c": 3.0}, aggregation=mode))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), mode
        assert lp.grad[0, 1] == 0
        assert all(torch.isfinite(v) for v in metrics.values())


def test_float16_token_counts_do_not_overflow():
    loss = torch.full((1, 70000), 0.5, dtype=torch.float16)
    mask = torch.ones(1, 70000, dtype=torch.bool)
    out = agg_loss(loss, mask, "token-mean")
    assert out.dtype == torch.float16 and out.item() == 0.5
    loss = torch.full((4, 40000), 0.5, dtype=torch.float16)
    out = agg_loss(loss, torch.ones(4, 40000, dtype=torch.bool), "token-mean")
    assert out.item() == 0.5
    out = agg_loss(loss, torch.ones(4, 40000, dtype=torch.bool), "seq-mean-token-mean")
    assert out.item() == 0.5


def test_seq_mean_token_sum_norm_with_no_tokens_is_zero():
    loss = torch.zeros(3, 0, requires_grad=True)
    out = agg_loss(loss, torch.zeros(3, 0, dtype=torch.bool), "seq-mean-token-sum-norm")
    assert out.item() == 0.0
    out.backward()


def test_the_gradient_helpers_and_weights_are_validated_like_the_losses():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        losses.agg_weights(m, "token-max")  # was: silently another mode's weights
    with pytest.raises(ValueError, match="kind"):
        losses.kl_penalty_grad(x, x, "k4")  # was: a bare KeyError
    with pytest.raises(ValueError, match="old_log_probs"):
        losses.policy_loss_grad(x, x[:1], x, m)  # was: a broadcast error
    with pytest.raises(ValueError, match="advantages"):
        losses.policy_loss_grad(x, x, x[:, :2], m)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses.policy_loss_grad(x, x, x, m, clip_ratio_c=0.5)


def test_negative_mask_weights_are_refused():
    x = torch.zeros(2, 3)
    w = torch.tensor([[1.0, 0.5, 0.0], [2.0, -0.1, 1.0]])
    for call in (lambda: agg_loss(x, w), lambda: policy_loss(x, x, x, w), lambda: entropy_bonus(x, w),
                 lambda: losses.agg_weights(w), lambda: losses.agg_loss(x, w.masked_fill(w < 0, math.nan))):
        with pytest.raises(ValueError, match="loss_mask"):
            call()
    # non-negative weights stay accepted
    agg_loss(x, w.clamp(min=0))
