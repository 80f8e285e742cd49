"""TRL 1.16.0, installed: the drop-ins against ``trl.trainer.utils`` and the head inside a real GRPOTrainer.

Every reference here is TRL's own installed code: the helpers of
``trl.trainer.utils`` (values and gradients, fp32 and bf16), and two real
``GRPOTrainer`` training steps on a tiny Qwen2 built from a local config
(random weights, a word-level tokenizer made here; no hub download), run
once as TRL ships it and once patched, with the same seed.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_entropy.integrations import trl as ce_trl
from tests.helpers import reference, require

require("transformers", "trl")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import trl
    import trl.trainer.utils as trl_utils
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

assert trl.__version__ == "1.16.0", trl.__version__


def _case(shape=(3, 7), v=41, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    index = torch.randint(0, v, shape, generator=g)
    return logits, index, g


def _grads(fn, logits, *args, ups, **kw):
    x = logits.clone().requires_grad_()
    outs = fn(x, *args, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o.float() * u).sum() for o, u in zip(outs, ups, strict=True) if o is not None and o.requires_grad).backward()
    return [o.detach() for o in outs], x.grad


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("k", [None, 3])
def test_selective_log_softmax_matches_trl(dtype, temperature, k):
    logits, index, g = _case(dtype=dtype)
    if k:
        index = torch.randint(0, logits.shape[-1], (*index.shape, k), generator=g)
    row_mask = (torch.rand(index.shape, generator=g) > 0.2).long()
    ups = [torch.randn(index.shape, generator=g)]
    (ours,), g_ours = _grads(ce_trl.selective_log_softmax, logits, index, temperature, row_mask, ups=ups)
    (theirs,), g_theirs = _grads(trl_utils.selective_log_softmax, logits, index, temperature, row_mask, ups=ups)
    assert ours.shape == theirs.shape == index.shape
    torch.testing.assert_close(ours, theirs.float(), **TOL[dtype])
    torch.testing.assert_close(g_ours.float(), g_theirs.float(), **TOL[dtype])
    assert (ours[row_mask == 0] == 0).all()
    # and against float64 (TRL's bf16 path is the looser)
    t = temperature
    ref = torch.log_softmax(logits.double() / t, -1).gather(-1, index if k else index[..., None])
    ref = ref if k else ref[..., 0]
    torch.testing.assert_close(ours.double(), torch.where(row_mask != 0, ref, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [-math.inf, torch.finfo(torch.float32).min, -1e30])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_with_k_ids_and_masked_logits_matches_trl(masked, temperature):
    """Masked logits (vocabulary padding, masked_fill) at the first of the K ids, and elsewhere in the row:
    the other ids' log-probs used to come out 0.0 or NaN, read off the masked first id."""
    logits, _, g = _case(shape=(4, 5), v=23)
    index = torch.randint(0, 23, (4, 5, 4), generator=g)
    logits[..., 20:] = masked  # padding columns
    index[..., 0] = 21  # the first id of every row is masked
    index[1, :, 2] = 22  # and another one further on
    logits[2, 3, 5] = masked  # a masked logit inside the vocabulary too
    index[2, 3, 1] = 5
    ups = [torch.randn(index.shape, generator=g)]
    (theirs,), g_theirs = _grads(trl_utils.selective_log_softmax, logits, index, temperature, ups=ups)
    (ours,), g_ours = _grads(ce_trl.selective_log_softmax, logits, index, temperature, ups=ups)
    finite = torch.isfinite(theirs)
    assert (theirs > -1e20).sum() > index.numel() // 2  # most ids are not masked: ordinary log-probs to compare
    assert torch.equal(finite, torch.isfinite(ours))
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[~finite], theirs[~finite])
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-5)


def test_drop_ins_name_a_float_index():
    logits, index, _ = _case()
    for idx in (index.float(), index[..., None].expand(3, 7, 2).float()):
        with pytest.raises(TypeError, match=r"index must hold integer ids \(int64\), got torch.float32"):
            ce_trl.selective_log_softmax(logits, idx)
    with pytest.raises(TypeError, match="index must hold integer ids"):
        ce_trl.selective_log_softmax_and_entropy(logits, index.float())


@pytest.mark.parametrize("temperature", [np.float32(0.7), torch.tensor(0.7), torch.tensor([0.7]), 2])
def test_temperatures_trl_accepts_are_accepted(temperature):
    """TRL divides by any real number or one-element tensor (``logits / temperature``): so do the drop-ins."""
    logits, index, g = _case()
    ups = [torch.randn(index.shape, generator=g), torch.randn(index.shape, generator=g)]
    for fn, args in ((ce_trl.selective_log_softmax, (index, temperature)),
                     (ce_trl.selective_log_softmax, (index[..., None].expand(3, 7, 2), temperature)),
                     (ce_trl.selective_log_softmax_and_entropy, (index, True, temperature))):
        theirs_fn = getattr(trl_utils, fn.__name__)
        n = 1 if fn is ce_trl.selective_log_softmax else 2
        up = [u.unsqueeze(-1).expand(args[0].shape) for u in ups[:n]] if args[0].dim() == 3 else ups[:n]
        ours, g_ours = _grads(fn, logits, *args, ups=up)
        theirs, g_theirs = _grads(theirs_fn, logits, *args, ups=up)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-5)


def test_temperature_that_is_no_number_is_named():
    logits, index, _ = _case()
    for bad in (None, "0.7", True, torch.full((3, 7), 0.7)):
        with pytest.raises(TypeError, match="temperature must be a float > 0"):
            ce_trl.selective_log_softmax(logits, index, bad)
        with pytest.raises(TypeError, match="temperature must be a float > 0"):
            ce_trl.selective_log_softmax_and_entropy(logits, index, True, bad)
    for bad in (0, -1.0, float("nan"), torch.tensor(0.0)):
        with pytest.raises(ValueError, match="temperature must be positive"):
            ce_trl.selective_log_softmax(logits, index, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [1, 2, 17])
def test_k_ids_half_precision_gradient_no_worse_than_trls(dtype, v):
    """(..., K) ids on half-precision logits: the gradient against float64 is no worse than TRL's autograd.

    It was formed from three half-precision pieces (the anchor's log-prob, and each id's and the anchor's
    logit) that cancel: at V = 1 (true gradient 0) it was off by one half-precision ulp of the upstream
    gradient, where TRL's is exact."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        z = (torch.randn(4, 3, v, generator=g, dtype=torch.float64) * 4).to(dtype)
        index = torch.randint(0, v, (4, 3, 5), generator=g)
        up = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
        z64 = z.double().requires_grad_()
        (torch.log_softmax(z64 / 0.5, -1).gather(-1, index) * up).sum().backward()
        errs = []
        for fn in (ce_trl.selective_log_softmax, trl_utils.selective_log_softmax):
            x = z.clone().requires_grad_()
            (fn(x, index, 0.5).double() * up).sum().backward()
            errs.append((x.grad.double() - z64.grad).abs().max().item())
        assert errs[0] <= errs[1] + 1e-5, (seed, errs)


def test_zero_ids_per_row_give_an_empty_result_as_trl():
    logits, _, _ = _case()
    index = torch.zeros(3, 7, 0, dtype=torch.int64)
    theirs = trl_utils.selective_log_softmax(logits, index)
    x = logits.clone().requires_grad_()
    ours = ce_trl.selective_log_softmax(x, index, 0.5)
    assert ours.shape == theirs.shape == (3, 7, 0) and ours.dtype == torch.float32
    ours.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits_matches_trl(dtype):
    logits, _, g = _case(shape=(2, 5, 3), dtype=dtype)
    ups = [torch.randn(logits.shape[:-1], generator=g)]
    (ours,), g_ours = _grads(ce_trl.entropy_from_logits, logits, 4, ups=ups)
    (theirs,), g_theirs = _grads(trl_utils.entropy_from_logits, logits, 4, ups=ups)
    torch.testing.assert_close(ours, theirs.float(), **TOL[dtype])
    torch.testing.assert_close(g_ours.float(), g_theirs.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_requires_grad", [True, False])
def test_selective_log_softmax_and_entropy_matches_trl(dtype, entropy_requires_grad):
    logits, index, g = _case(dtype=dtype)
    row_mask = torch.rand(index.shape, generator=g) > 0.3
    ups = [torch.randn(index.shape, generator=g), torch.randn(index.shape, generator=g)]
    args = (index, entropy_requires_grad, 0.8, row_mask)
    ours, g_ours = _grads(ce_trl.selective_log_softmax_and_entropy, logits, *args, ups=ups)
    theirs, g_theirs = _grads(trl_utils.selective_log_softmax_and_entropy, logits, *args, ups=ups)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b.float(), **TOL[dtype])
    torch.testing.assert_close(g_ours.float(), g_theirs.float(), **TOL[dtype])


def test_drop_ins_reject_bad_input_naming_it():
    logits, index, _ = _case()
    with pytest.raises(ValueError, match="index"):
        ce_trl.selective_log_softmax(logits, index[:, :3])
    with pytest.raises(ValueError, match="row_mask"):
        ce_trl.selective_log_softmax(logits, index, row_mask=torch.ones(2))
    with pytest.raises(ValueError, match="temperature"):
        ce_trl.selective_log_softmax(logits, index, 0.0)
    # an id outside the vocabulary, -1 and -100 included: TRL's gather raises for each, and so do we, naming index
    for bad in (41, -1, -100):
        wrong = index.clone()
        wrong[1, 2] = bad
        with pytest.raises((RuntimeError, IndexError)):
            trl_utils.selective_log_softmax(logits, wrong)
        with pytest.raises(ValueError, match=rf"index must hold class ids in \[0, 41\); found {bad}"):
            ce_trl.selective_log_softmax(logits, wrong)
        with pytest.raises(ValueError, match="index"):
            ce_trl.selective_log_softmax_and_entropy(logits, wrong)


def test_fused_head_kernel_matches_trls_kernel():
    """The stand-in against TRL's ChunkedLogProbFunction itself: softcap, logit scale, temperature, bias."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(19, 8, generator=g), torch.randn(50, 8, generator=g)
    bias = torch.randn(50, generator=g)
    targets = torch.randint(0, 50, (19,), generator=g)
    ups = [torch.randn(19, generator=g) for _ in range(2)]
    args = (targets, 0.7, 16, 5.0, 0.5, ("log_probs", "entropy", "log_sum_sq_probs"))

    def run(kernel):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        out = kernel.apply(*leaves, *args)
        (out[0] * ups[0] + out[1] * ups[1]).sum().backward()
        return out, [t.grad for t in leaves]

    ours, g_ours = run(ce_trl.FusedHeadKernel(chunk_size=4))
    theirs, g_theirs = run(trl_utils._ChunkedLogProbFunction)
    for a, b in zip(ours[:3], theirs[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours[3] is None and ours[4] is None
    for a, b in zip(g_ours, g_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the transform against float64 from its definition
    lp, h = reference(hidden.double() @ weight.double().T + bias.double(), targets, temperature=0.7,
                      softcap=5.0, logit_scale=0.5)
    torch.testing.assert_close(ours[0].double(), lp, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="mean_logits"):
        ce_trl.FusedHeadKernel().apply(hidden, weight, None, targets, 1.0, 16, None, 1.0, ("log_probs", "mean_logits"))


# ----------------------------------------------------------------------------- a real GRPOTrainer


def _tokenizer():
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>"] + [f"w{i}" for i in range(62)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def _train(tmp_path, patch, *, rloo=False, **config):
    """Two GRPO (or RLOO) steps, with a reference model and temperature (GRPO: and an entropy bonus)."""
    tok = _tokenizer()
    path = tmp_path / "model"
    if not path.exists():
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False)
        Qwen2ForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 60}" for j in range(4)) for i in range(8)]})
    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    if not rloo:
        config.setdefault("entropy_coef", 0.05)
    args = config_cls(
        output_dir=str(tmp_path / ("patched" if patch else "trl")), per_device_train_batch_size=4,
        num_generations=2, max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-2,
        report_to="none", use_cpu=True, seed=0, temperature=0.8, beta=0.04,
        save_strategy="no", bf16=False, model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, **config,
    )
    trainer = trainer_cls(model=str(path), reward_funcs=_reward, args=args, train_dataset=data, processing_class=tok)
    kernel = ce_trl.patch_trainer(trainer, chunk_size=3) if patch else None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, kernel, trainer


@pytest.mark.parametrize(
    "config", [{}, {"cast_lm_head_to_fp32": True, "num_iterations": 2}], ids=["default", "fp32_head"]
)
def test_two_grpo_steps_match_trls_own_path(tmp_path, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, _, _ = _train(tmp_path, patch=False, **config)
        ours, kernel, trainer = _train(tmp_path, patch=True, **config)
    assert len(ours) == len(theirs) == 2
    # policy (loss step) and reference model each call the head every step; old log-probs too with 2 iterations
    assert kernel.calls >= 4
    for a, b in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])
    # patch_trainer is idempotent and undone by unpatch_trainer
    assert ce_trl.patch_trainer(trainer) is kernel
    ce_trl.unpatch_trainer(trainer)
    assert "_get_per_token_logps_and_entropies" not in trainer.__dict__


def test_two_rloo_steps_match_trls_own_path(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, _, _ = _train(tmp_path, patch=False, rloo=True)
        ours, kernel, _ = _train(tmp_path, patch=True, rloo=True)
    assert len(ours) == len(theirs) == 2 and kernel.calls >= 4
    for a, b in zip(ours, theirs, strict=True):
        assert {"loss", "grad_norm", "kl"} <= set(b)
        for key in ("loss", "grad_norm", "entropy", "kl"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])


def test_batch_size_and_compute_entropy_are_honoured(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, trainer = _train(tmp_path, patch=False)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, 64, (5, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    theirs = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, 4, batch_size=2, compute_entropy=True
    )
    kernel = ce_trl.patch_trainer(trainer)
    ours = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, 4, batch_size=2, compute_entropy=True
    )
    assert kernel.calls == 3  # batch_size=2 over 5 sequences: three calls of the head
    assert len(ours) == 3 and ours[2] is None
    for a, b in zip(ours[:2], theirs[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 4)
    assert entropies is None and logps.shape == (5, 4)


def test_patch_trainer_refuses_what_it_cannot_patch():
    with pytest.raises(TypeError, match="_get_per_token_logps_and_entropies"):
        ce_trl.patch_trainer(object())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), v=st.integers(2, 40), k=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1), masked=st.sampled_from([-math.inf, torch.finfo(torch.float32).min, -1e30]),
    where=st.sampled_from(["first", "anywhere", "padding", "none"]), t=st.sampled_from([1.0, 0.6, 2.5]),
    row_mask=st.booleans(),
)
def test_fuzz_k_index_with_masked_logits_matches_trl(lead, v, k, seed, masked, where, t, row_mask):
    """TRL's selective_log_softmax over (..., K) ids, with masked logits among the ids: values and gradients."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead, v, generator=g) * 3
    index = torch.randint(0, v, (*lead, k), generator=g)
    flat_z, flat_i = logits.view(-1, v), index.view(-1, k)
    if where == "padding" and v > 2:
        logits[..., v - 2:] = masked
        flat_i[:, 0] = v - 1
    elif where != "none":
        for r in range(flat_z.shape[0]):
            j = int(torch.randint(0, v - 1, (), generator=g))  # one masked logit a row, never the whole row
            flat_z[r, j] = masked
            col = 0 if where == "first" else int(torch.randint(0, k, (), generator=g))
            flat_i[r, col] = j
    mask = (torch.rand(index.shape, generator=g) > 0.3).long() if row_mask else None
    ups = [torch.randn(index.shape, generator=g)]
    (theirs,), g_theirs = _grads(trl_utils.selective_log_softmax, logits, index, t, mask, ups=ups)
    (ours,), g_ours = _grads(ce_trl.selective_log_softmax, logits, index, t, mask, ups=ups)
    finite = torch.isfinite(theirs)
    assert torch.equal(finite, torch.isfinite(ours))
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[~finite], theirs[~finite])
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [0, -2, 2.5, True, None])
def test_a_bad_chunk_size_is_named_chunk_size(chunk_size):
    """The drop-ins' own keyword is named, not the core's ``chunking``; ``"auto"`` is taken."""
    logits, index, _ = _case()
    for call in (lambda: ce_trl.selective_log_softmax(logits, index, chunk_size=chunk_size),
                 lambda: ce_trl.selective_log_softmax_and_entropy(logits, index, chunk_size=chunk_size),
                 lambda: ce_trl.entropy_from_logits(logits, chunk_size)):
        with pytest.raises(ValueError, match=rf"^chunk_size must be an int >= 1, got {chunk_size!r}"):
            call()
    want = trl_utils.selective_log_softmax(logits, index)
    torch.testing.assert_close(ce_trl.selective_log_softmax(logits, index, chunk_size="auto"), want)


def test_a_nested_tensor_is_named_not_an_internal_error():
    """torch raises 'NestedTensorImpl doesn't support sizes' on reading a nested tensor's shape: named instead."""
    logits = torch.nested.nested_tensor([torch.randn(2, 5), torch.randn(3, 5)], layout=torch.jagged)
    index = torch.nested.nested_tensor([torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)],
                                       layout=torch.jagged)
    for call in (lambda: ce_trl.selective_log_softmax(logits, index), lambda: ce_trl.entropy_from_logits(logits),
                 lambda: ce_trl.selective_log_softmax_and_entropy(logits, index)):
        with pytest.raises(TypeError, match="logits must be a dense tensor .* got a nested tensor"):
            call()
    with pytest.raises(TypeError, match="index must be a dense tensor of int64 ids, got a nested tensor"):
        ce_trl.selective_log_softmax(logits.values(), index)
