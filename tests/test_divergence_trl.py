"""Against TRL 1.16's own ChunkedDivergenceFunction (trl/kernels/chunked_divergence.py, installed; on the CPU it
runs its torch tiles): the same inputs, values and gradients within float32 rounding, for TRL's beta 0 (forward
KL), 0.3 and 0.5 (generalized JSD) and 1 (reverse KL), with soft-caps, logit scales and a scalar temperature."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import require

require("trl")

from trl.kernels.chunked_divergence import ChunkedDivergenceFunction  # noqa: E402

from chunked_entropy import Divergence, OutputLayer, linear_divergence, linear_divergence_loss  # noqa: E402
from chunked_entropy.integrations.trl import divergence_keywords  # noqa: E402
from tests.test_divergence import reference  # noqa: E402  (the float64 definitions)

BETAS = [0.0, 0.3, 0.5, 1.0]
SETTINGS = {
    "plain": dict(),
    "soft-caps, logit scales, temperature": dict(
        temperature=0.7, student_logit_scale=1.25, teacher_logit_scale=0.8,
        student_final_logit_softcapping=6.0, teacher_final_logit_softcapping=9.0,
    ),
    "student soft-cap only, temperature 2": dict(temperature=2.0, student_final_logit_softcapping=4.0),
}


def _inputs(seed, n=50, hs=24, ht=40, v=333, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    new = lambda *s, k=1.0: (torch.randn(*s, generator=g) * k).to(dtype)  # noqa: E731
    return (new(n, hs), new(v, hs, k=3 / hs**0.5), new(v, k=0.3), new(n, ht), new(v, ht, k=4 / ht**0.5),
            new(v, k=0.3), torch.randn(n, generator=g))


def _trl(hs, ws, bs, ht, wt, bt, beta, s):
    return ChunkedDivergenceFunction.apply(
        hs, ws, bs, ht, wt, bt, beta, s.get("temperature", 1.0), s.get("student_logit_scale", 1.0),
        s.get("student_final_logit_softcapping"), s.get("teacher_logit_scale", 1.0),
        s.get("teacher_final_logit_softcapping"))


def _ours(beta, s, ws, bs, wt, bt, logits_dtype=None):
    """TRL's settings in 0.2's form: ``(student_layer, teacher_layer, keywords)``; TRL's beta through
    ``Divergence.from_trl_beta``, a logit scale of 1.0 (TRL's default) as none."""
    scale = lambda x: None if x == 1.0 else x  # noqa: E731
    student = OutputLayer(ws, bs, softcap=s.get("student_final_logit_softcapping"),
                          logit_scale=scale(s.get("student_logit_scale", 1.0)), logits_dtype=logits_dtype)
    teacher = OutputLayer(wt, bt, softcap=s.get("teacher_final_logit_softcapping"),
                          logit_scale=scale(s.get("teacher_logit_scale", 1.0)), logits_dtype=logits_dtype)
    return student, teacher, dict(divergence=Divergence.from_trl_beta(beta), temperature=s.get("temperature", 1.0))


def test_divergence_keywords_are_0_1s_form_of_the_same_settings():
    """``divergence_keywords`` (kept for 0.1's callers) names what ``Divergence.from_trl_beta`` and the layers hold."""
    for beta in BETAS:
        with pytest.warns(DeprecationWarning, match=r"0\.1's and go in 0\.3\.0.*Divergence\.from_trl_beta"):
            kw = divergence_keywords(beta, temperature=2.0, student_logit_scale=1.0, teacher_logit_scale=0.5,
                                     student_softcap=30.0)
        d = Divergence.from_trl_beta(beta)
        assert (kw["divergence"], kw["beta"], kw["temperature"]) == (d.kind, d.beta, 2.0)
        assert (kw["student_logit_scale"], kw["teacher_logit_scale"], kw["student_softcap"]) == (None, 0.5, 30.0)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("beta", BETAS)
def test_values_and_gradients_equal_trls(beta, setting):
    s = SETTINGS[setting]
    hs, ws, bs, ht, wt, bt, up = _inputs(int(beta * 10) + len(setting))
    a = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    d_trl, ent_trl = _trl(*a, ht, wt, bt, beta, s)
    (d_trl * up).sum().backward()
    b = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    student, teacher, kw = _ours(beta, s, b[1], b[2], wt, bt)
    out = linear_divergence(b[0], student, ht, teacher, compute_entropy=True, chunking=16, **kw)
    (out.divergence * up).sum().backward()
    tol = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.divergence, d_trl, **tol)
    torch.testing.assert_close(out.entropy, ent_trl, **tol)
    for x, y, name in zip(b, a, ("hidden", "weight", "bias"), strict=True):
        torch.testing.assert_close(x.grad, y.grad, **tol, msg=lambda m, name=name: f"grad {name}: {m}")
    # the loss form: TRL's trainer reduces with a mean over the valid rows
    c = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    mask = up > -0.5
    student, teacher, kw = _ours(beta, s, c[1], c[2], wt, bt)
    res = linear_divergence_loss(c[0], student, ht, teacher, label_mask=mask, chunking=16, **kw)
    res.loss.backward()
    e = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    d2, _ = _trl(*e, ht, wt, bt, beta, s)
    ((d2 * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(res.loss, (d2.detach() * mask).sum() / mask.sum(), **tol)
    for x, y in zip(c, e, strict=True):
        torch.testing.assert_close(x.grad, y.grad, **tol)


@pytest.mark.parametrize("beta", BETAS)
def test_bf16_no_worse_than_trl_on_the_same_inputs(beta):
    s = SETTINGS["soft-caps, logit scales, temperature"]
    hs, ws, bs, ht, wt, bt, up = _inputs(3, dtype=torch.bfloat16)
    ref = [t.double().requires_grad_() for t in (hs, ws, bs)]
    st, te, kw = _ours(beta, s, ws, bs, wt, bt)
    d_ref = reference(ref[0] @ ref[1].t() + ref[2], ht.double() @ wt.double().t() + bt.double(),
                      kw["divergence"].kind, kw["divergence"].beta, temperature=kw["temperature"],
                      student=dict(softcap=st.softcap, logit_scale=st.logit_scale),
                      teacher=dict(softcap=te.softcap, logit_scale=te.logit_scale))
    g_ref = torch.autograd.grad((d_ref * up.double()).sum(), ref)
    a = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    d_trl, _ = _trl(*a, ht, wt, bt, beta, s)
    g_trl = torch.autograd.grad((d_trl * up).sum(), a)
    b = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    # TRL projects bf16 inputs to float32 logits: the same choice here is logits_dtype=torch.float32
    student, teacher, kw = _ours(beta, s, b[1], b[2], wt, bt, logits_dtype=torch.float32)
    d = linear_divergence(b[0], student, ht, teacher, **kw).divergence
    g = torch.autograd.grad((d * up).sum(), b)
    err = lambda x, y: (x.double() - y).abs().max().item()  # noqa: E731
    assert err(d, d_ref) <= 1.5 * err(d_trl, d_ref) + 1e-6
    for x, y, r in zip(g, g_trl, g_ref, strict=True):
        assert err(x, r) <= 1.5 * err(y, r) + 1e-6


# ----------------------------------------------------------------------------- a real DistillationTrainer


def _distill(tmp_path, patch, beta):
    """Two DistillationTrainer steps: a tiny Qwen2 student (width 32) and a wider teacher (width 48) from local
    configs with random weights, a word-level tokenizer made here (no hub download)."""
    import warnings

    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>"] + [f"w{i}" for i in range(62)])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    paths = {}
    for name, width in (("student", 32), ("teacher", 48)):
        paths[name] = tmp_path / name
        if not paths[name].exists():
            torch.manual_seed(1 if name == "teacher" else 0)
            cfg = Qwen2Config(vocab_size=64, hidden_size=width, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              tie_word_embeddings=False)
            Qwen2ForCausalLM(cfg).save_pretrained(paths[name])
            tok.save_pretrained(paths[name])
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 60}" for j in range(4)) for i in range(8)]})
    args = DistillationConfig(
        output_dir=str(tmp_path / ("patched" if patch else "trl")), per_device_train_batch_size=4,
        max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-2, report_to="none", use_cpu=True,
        seed=0, temperature=0.8, beta=beta, save_strategy="no", bf16=False, disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DistillationTrainer(model=str(paths["student"]), teacher_model=str(paths["teacher"]), args=args,
                                      train_dataset=data, processing_class=tok)
        from chunked_entropy.integrations import trl as ce_trl

        loss_fn = ce_trl.patch_distillation_trainer(trainer, chunk_size=5) if patch else None
        trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], loss_fn, trainer


def test_two_distillation_trainer_steps_match_trls_own_path(tmp_path, beta=0.5):
    from chunked_entropy.integrations import trl as ce_trl

    theirs, _, _ = _distill(tmp_path, False, beta)
    ours, loss_fn, trainer = _distill(tmp_path, True, beta)
    assert len(ours) == len(theirs) == 2 and loss_fn.calls >= 2
    assert all(b["loss"] > 0 and b["entropy"] > 0 for b in theirs)
    for a, b in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])
    assert ce_trl.patch_distillation_trainer(trainer) is loss_fn  # idempotent
    ce_trl.unpatch_distillation_trainer(trainer)
    assert "_compute_loss" not in trainer.__dict__
    with pytest.raises(TypeError, match="DistillationTrainer"):
        ce_trl.patch_distillation_trainer(object())


@pytest.mark.parametrize("num_items", [None, 7])
def test_chunked_divergence_loss_equals_trls(num_items):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from chunked_entropy.integrations.trl import chunked_divergence_loss

    g = torch.Generator().manual_seed(4)
    hs, ht = torch.randn(3, 6, 16, generator=g), torch.randn(3, 6, 24, generator=g)
    ws, wt = torch.randn(50, 16, generator=g) / 2, torch.randn(50, 24, generator=g) / 2
    mask = (torch.rand(3, 6, generator=g) > 0.3).long()
    mask[1] = 0  # a sequence with no completion token
    kw = dict(student_final_logit_softcapping=5.0, teacher_logit_scale=1.5, temperature=0.8,
              num_items_in_batch=num_items)
    results = []
    for fn in (_chunked_divergence_loss, chunked_divergence_loss):
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss, ent, n = fn(h, ht, w, wt, mask, 0.3, **kw)
        loss.backward()
        results.append((loss.detach(), ent.detach(), n, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    assert results[0][3][1].abs().max() == 0  # masked rows: no gradient


@pytest.mark.parametrize("case", ["bf16 teacher", "fp16 student, all-zero mask"])
def test_chunked_divergence_loss_equals_trls_with_half_precision_models(case):
    """TRL projects both models to float32 logits: a bf16 teacher beside a float32 student too (the adapter
    used to round the teacher's logits to bf16); a micro-batch without a completion token gives TRL's 0."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from chunked_entropy.integrations.trl import chunked_divergence_loss

    g = torch.Generator().manual_seed(5)
    s_dtype, t_dtype = (torch.float32, torch.bfloat16) if case == "bf16 teacher" else (torch.float16, torch.float16)
    hs, ht = torch.randn(2, 5, 16, generator=g).to(s_dtype), torch.randn(2, 5, 24, generator=g)
    ht[..., 0] = 30.0  # teacher logits near 300, where bf16 rounds to 2
    ws, wt = torch.randn(40, 16, generator=g) / 2, torch.randn(40, 24, generator=g) / 2
    wt[:, 0] = 10.0 + torch.rand(40, generator=g) * 0.3
    mask = torch.ones(2, 5, dtype=torch.int64) if case == "bf16 teacher" else torch.zeros(2, 5, dtype=torch.int64)
    if s_dtype == torch.float16:  # a weight whose fp16 sum overflows (weight.sum() * 0 is NaN)
        ws = torch.full_like(ws, 120.0)
        assert torch.isinf(ws.half().sum())
    ht, wt, ws = ht.to(t_dtype), wt.to(t_dtype), ws.to(s_dtype)
    results = []
    for fn in (_chunked_divergence_loss, chunked_divergence_loss):
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss, ent, n = fn(h, ht, w, wt, mask, 0.0)
        loss.backward()
        results.append((loss.detach().float(), ent.detach().float(), n, h.grad.float(), w.grad.float()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    if case != "bf16 teacher":
        assert results[1][0].item() == 0.0 and torch.isfinite(results[1][4]).all()
