"""Reading a verl actor section (``Chunking.from_config``), and the deprecated ``ChunkedEntropyConfig``: field
checks, the "auto" chunk size."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from chunked_entropy import ChunkedEntropyConfig, Chunking, log_probs_and_entropy
from chunked_entropy.config import read_actor_config

# A trimmed copy of the keys verl's actor section really has
# (verl/trainer/config/actor/actor.yaml + megatron_actor.yaml).
VERL_ACTOR = {
    "strategy": "megatron",
    "ppo_mini_batch_size": 256,
    "ppo_micro_batch_size_per_gpu": None,
    "use_dynamic_bsz": False,
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean",
    "entropy_coeff": 0,
    "use_kl_loss": False,
    "kl_loss_type": "low_var_kl",
    "policy_loss": {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002},
    "optim": {"lr": 1e-6, "weight_decay": 0.01},
    "megatron": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
}


def test_defaults_and_fixed_chunk_size():
    cfg = ChunkedEntropyConfig()
    assert (cfg.chunk_size, cfg.vocab_chunk_size, cfg.fused_head, cfg.temperature, cfg.compute_entropy) == (
        1024, None, False, 1.0, True,
    )
    # An int chunk size is used as is, whatever the vocabulary.
    assert ChunkedEntropyConfig(chunk_size=7).resolve_chunk_size(10**6) == 7
    assert ChunkedEntropyConfig(temperature=2).temperature == 2.0
    assert isinstance(ChunkedEntropyConfig(temperature=2).temperature, float)


def test_auto_chunk_size_formula():
    # Budget / (buffers * 4 bytes * width), by hand.
    cfg = ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=8_000_000)
    assert cfg.resolve_chunk_size(1000) == 8_000_000 // (2 * 4 * 1000) == 1000
    assert cfg.resolve_chunk_size(3000) == 333  # floor(8e6 / 24000) = 333.3
    no_ent = dataclasses.replace(cfg, compute_entropy=False)
    assert no_ent.resolve_chunk_size(1000) == 2000  # one buffer
    # A per-call entropy switch overrides the config's.
    assert no_ent.resolve_chunk_size(1000, compute_entropy=True) == 1000
    assert cfg.resolve_chunk_size(1000, compute_entropy=False) == 2000
    # Never below 1, even when one token's buffers exceed the budget.
    assert ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=1).resolve_chunk_size(50_000) == 1
    # Vocabulary blocking narrows the buffers only on the fused path.
    blocked = ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=8_000_000, vocab_chunk_size=500, fused_head=True)
    assert blocked.resolve_chunk_size(1000) == 2000
    assert blocked.resolve_chunk_size(1000, fused=False) == 1000
    assert blocked.resolve_chunk_size(200) == 5000  # block wider than the shard: the shard
    assert dataclasses.replace(blocked, fused_head=False).resolve_chunk_size(1000) == 1000
    assert dataclasses.replace(blocked, fused_head=False).resolve_chunk_size(1000, fused=True) == 2000


@pytest.mark.parametrize(
    "field,value",
    [
        ("chunk_size", 0), ("chunk_size", -3), ("chunk_size", 2.5), ("chunk_size", True),
        ("chunk_size", "AUTO"), ("chunk_size", None), ("chunk_size", "1024"),
        ("max_chunk_bytes", 0), ("max_chunk_bytes", 1.5),
        ("vocab_chunk_size", 0), ("vocab_chunk_size", "x"),
        ("fused_head", 1), ("fused_head", "yes"),
        ("compute_entropy", None),
        ("temperature", 0), ("temperature", -1.0), ("temperature", float("inf")),
        ("temperature", float("nan")), ("temperature", True), ("temperature", "1.0"),
    ],
)
def test_bad_field_names_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        ChunkedEntropyConfig(**{field: value})


def test_resolve_rejects_bad_arguments():
    cfg = ChunkedEntropyConfig(chunk_size="auto")
    with pytest.raises(ValueError, match="v_local"):
        cfg.resolve_chunk_size(0)
    with pytest.raises(ValueError, match="fused"):
        cfg.resolve_chunk_size(10, fused=1)
    with pytest.raises(ValueError, match="compute_entropy"):
        cfg.resolve_chunk_size(10, compute_entropy="yes")


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ChunkedEntropyConfig().chunk_size = 3


@pytest.mark.parametrize("wrap", [dict, OmegaConf.create], ids=["dict", "DictConfig"])
def test_from_verl_actor_section(wrap):
    # Settings under the sub-key; verl's own keys are ignored; entropy_coeff == 0: no entropy.
    actor = dict(VERL_ACTOR, chunked_entropy={"chunk_size": 512, "vocab_chunk_size": 4096, "fused_head": True})
    cfg = ChunkedEntropyConfig.from_actor_config(wrap(actor))
    assert cfg == ChunkedEntropyConfig(chunk_size=512, vocab_chunk_size=4096, fused_head=True, compute_entropy=False)
    # Nonzero entropy_coeff turns the entropy on (verl's rule for the update).
    on = ChunkedEntropyConfig.from_actor_config(wrap(dict(actor, entropy_coeff=0.001)))
    assert on.compute_entropy is True and on.chunk_size == 512


@pytest.mark.parametrize("wrap", [dict, OmegaConf.create], ids=["dict", "DictConfig"])
def test_fields_at_the_actor_level(wrap):
    actor = dict(VERL_ACTOR, chunk_size="auto", max_chunk_bytes=2**20, temperature=0.7)
    cfg = ChunkedEntropyConfig.from_actor_config(wrap(actor))
    assert (cfg.chunk_size, cfg.max_chunk_bytes, cfg.temperature) == ("auto", 2**20, 0.7)
    # The same value in both places is fine; different values are an error naming both keys.
    same = dict(actor, chunked_entropy={"chunk_size": "auto"})
    assert ChunkedEntropyConfig.from_actor_config(wrap(same)).chunk_size == "auto"
    clash = dict(actor, chunked_entropy={"chunk_size": 64})
    with pytest.raises(ValueError, match=r"chunk_size='auto' and chunked_entropy\.chunk_size=64 disagree"):
        ChunkedEntropyConfig.from_actor_config(wrap(clash))


def test_hydra_style_override_on_a_dictconfig():
    # What `+actor_rollout_ref.actor.chunked_entropy.chunk_size=1024` produces in verl's config tree.
    root = OmegaConf.create({"actor_rollout_ref": {"actor": VERL_ACTOR}})
    override = OmegaConf.from_dotlist(["actor_rollout_ref.actor.chunked_entropy.chunk_size=1024",
                                       "actor_rollout_ref.actor.entropy_coeff=0.01"])
    root = OmegaConf.merge(root, override)
    cfg = ChunkedEntropyConfig.from_actor_config(root.actor_rollout_ref.actor)
    assert cfg.chunk_size == 1024 and cfg.compute_entropy is True
    # `chunk_size=auto` on the command line arrives as the string "auto".
    auto = OmegaConf.merge(root, OmegaConf.from_dotlist(["actor_rollout_ref.actor.chunked_entropy.chunk_size=auto"]))
    assert ChunkedEntropyConfig.from_actor_config(auto.actor_rollout_ref.actor).chunk_size == "auto"


def test_entropy_switch_precedence():
    read = ChunkedEntropyConfig.from_actor_config
    assert read({}).compute_entropy is True  # nothing says: the default
    assert read({"entropy_coeff": 0.0}).compute_entropy is False
    assert read({"entropy_coeff": -0.01}).compute_entropy is True
    assert read({"entropy_coeff": 0.0, "calculate_entropy": True}).compute_entropy is True
    # verl's rule: calculate_entropy or entropy_coeff != 0 (verl's YAML ships calculate_entropy: false
    # next to a nonzero entropy_coeff, and then computes the entropy)
    assert read({"entropy_coeff": 0.5, "calculate_entropy": False}).compute_entropy is True
    assert read({"entropy_coeff": 0.0, "calculate_entropy": False}).compute_entropy is False
    assert read({"entropy_coeff": 0.5, "chunked_entropy": {"calculate_entropy": False}}).compute_entropy is True
    assert read({"calculate_entropy": True, "chunked_entropy": {"compute_entropy": False}}).compute_entropy is False
    assert read({"chunked_entropy": None}) == ChunkedEntropyConfig()


@pytest.mark.parametrize(
    "actor,key",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunked_entropy": {"chunk_size": -1}}, r"chunked_entropy\.chunk_size"),
        ({"chunked_entropy": {"chunk_size": "big"}}, r"chunked_entropy\.chunk_size"),
        ({"chunked_entropy": {"max_chunk_bytes": 0}}, r"chunked_entropy\.max_chunk_bytes"),
        ({"chunked_entropy": {"vocab_chunk_size": 1.5}}, r"chunked_entropy\.vocab_chunk_size"),
        ({"chunked_entropy": {"fused_head": "true"}}, r"chunked_entropy\.fused_head"),
        ({"chunked_entropy": {"temperature": 0.0}}, r"chunked_entropy\.temperature"),
        ({"temperature": -2}, "temperature"),
        ({"chunked_entropy": {"compute_entropy": 1}}, r"chunked_entropy\.compute_entropy"),
        ({"calculate_entropy": "yes"}, "calculate_entropy"),
        ({"entropy_coeff": "0.1"}, "entropy_coeff"),
        ({"entropy_coeff": float("nan")}, "entropy_coeff"),
        ({"chunked_entropy": {"chunk_sise": 8}}, r"chunked_entropy\.chunk_sise is not a setting"),
    ],
)
@pytest.mark.parametrize("wrap", [dict, OmegaConf.create], ids=["dict", "DictConfig"])
def test_bad_values_name_the_key(actor, key, wrap):
    for read in (ChunkedEntropyConfig.from_actor_config, Chunking.from_config):
        with pytest.raises(ValueError, match=rf"^{key}"):
            read(wrap(actor))


def test_bad_section_types():
    with pytest.raises(TypeError, match="cfg must be a dict, an OmegaConf DictConfig"):
        ChunkedEntropyConfig.from_actor_config([("chunk_size", 8)])
    with pytest.raises(TypeError, match="chunked_entropy must be a mapping"):
        ChunkedEntropyConfig.from_actor_config({"chunked_entropy": 1024})


def test_omegaconf_missing_value_is_an_error_not_the_default():
    actor = OmegaConf.create({"entropy_coeff": 0.0, "chunked_entropy": {"chunk_size": "???"}})
    with pytest.raises(ValueError, match=r"chunk_size is \?\?\?"):
        ChunkedEntropyConfig.from_actor_config(actor)
    with pytest.raises(ValueError, match=r"^entropy_from_logits_chunk_size is \?\?\?"):
        ChunkedEntropyConfig.from_actor_config(OmegaConf.create({"entropy_from_logits_chunk_size": "???"}))


@pytest.mark.parametrize("t", [1e-300, 1e-39])
def test_temperature_whose_reciprocal_overflows_is_rejected_as_the_functions_do(t):
    with pytest.raises(ValueError, match="temperature"):
        ChunkedEntropyConfig(temperature=t)
    with pytest.raises(ValueError, match="temperature"):  # the same bound as the functions
        log_probs_and_entropy(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=t)
    assert ChunkedEntropyConfig(temperature=1e-30).temperature == 1e-30


def test_verl_chunk_size_key_is_read():
    cfg = ChunkedEntropyConfig.from_actor_config({"entropy_from_logits_chunk_size": 512, "entropy_coeff": 0.01})
    assert cfg.chunk_size == 512 and cfg.compute_entropy is True
    # our own key wins
    cfg = ChunkedEntropyConfig.from_actor_config({"entropy_from_logits_chunk_size": 512, "chunk_size": 64})
    assert cfg.chunk_size == 64


def test_backend_key():
    assert ChunkedEntropyConfig.from_actor_config({"chunked_entropy": {"backend": "compile"}}).backend == "compile"
    with pytest.raises(ValueError, match=r"^chunked_entropy\.backend must be"):
        ChunkedEntropyConfig.from_actor_config({"chunked_entropy": {"backend": "fast"}})


def test_chunked_entropy_config_is_deprecated_and_keeps_working():
    with pytest.warns(DeprecationWarning, match="ChunkedEntropyConfig is deprecated .* Chunking is the one chunk"):
        cfg = ChunkedEntropyConfig(chunk_size=64, vocab_chunk_size=128, backend="eager")
    with pytest.warns(DeprecationWarning, match="ChunkedEntropyConfig is deprecated"):
        ChunkedEntropyConfig.from_actor_config({"chunked_entropy": {"chunk_size": 8}})
    assert Chunking.from_config(cfg) == Chunking(64, 128, "eager")


@pytest.mark.parametrize("wrap", [dict, OmegaConf.create], ids=["dict", "DictConfig"])
def test_chunking_reads_an_actor_section_alone(wrap):
    """``Chunking.from_config`` reads the section itself (no deprecated object built, no warning), with the
    same rules: the sub-key, the actor level, verl's own chunk key, the clash of the two places."""
    actor = dict(VERL_ACTOR, max_chunk_bytes=2**20,
                 chunked_entropy={"chunk_size": "auto", "vocab_chunk_size": 4096, "fused_head": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert Chunking.from_config(wrap(actor)) == Chunking("auto", 4096, max_chunk_bytes=2**20)
        assert Chunking.from_config(wrap(dict(VERL_ACTOR, entropy_from_logits_chunk_size=96))) == Chunking(96)
        assert Chunking.from_config(wrap({})) == Chunking()
        with pytest.raises(ValueError, match=r"chunk_size=32 and chunked_entropy\.chunk_size=64 disagree"):
            Chunking.from_config(wrap({"chunk_size": 32, "chunked_entropy": {"chunk_size": 64}}))
        assert read_actor_config(wrap({"entropy_coeff": 0.0, "chunked_entropy": {"chunk_size": 512}})) == {
            "chunk_size": 512, "compute_entropy": False}


def test_walk_plan_sizes_every_walk_in_one_place():
    """``config.walk_plan`` is where a call's sizes are decided (the ops' ``plan_for`` and ``chunked-entropy plan``
    read it); the figures worked by hand from the documented rules."""
    from chunked_entropy.cli.plan import Shape, blocks
    from chunked_entropy.config import walk_plan

    cpu = torch.device("cpu")

    def plan(chunking, **kw):
        return walk_plan(chunking, device=cpu, kernels=False, **kw)

    # the whole shard a block while a float32 [1024, V] buffer is at most 128 MiB: 32768 columns
    p = plan(Chunking(), tokens=8192, width=32768, dtype=torch.float32)
    assert (p.chunk_size, p.vocab_chunk_size, p.grad_vocab_chunk_size, p.block_dtype) == (1024, 32768, None, None)
    # 151936 columns: the widest multiple of 128 within 128 MiB; bf16's backward: a [8192, Vg] bf16 buffer of
    # 64 MiB, 4096 columns; with float32 logits 2048
    p = plan(Chunking(), tokens=8192, width=151936, dtype=torch.bfloat16, weight_grad=True)
    assert (p.vocab_chunk_size, p.grad_vocab_chunk_size) == (32768, 4096)
    assert plan(Chunking(), tokens=8192, width=151936, dtype=torch.bfloat16, weight_grad=True,
                float32_logits=True).grad_vocab_chunk_size == 2048
    assert plan(Chunking(), tokens=8192, width=151936, dtype=torch.bfloat16).grad_vocab_chunk_size is None
    # no wider than the forward's block; vocab_chunk_size given wins (at most the shard)
    assert plan(Chunking(vocab_chunk_size=1000), tokens=8192, width=151936, dtype=torch.float16,
                weight_grad=True).grad_vocab_chunk_size == 1000
    assert plan(Chunking(vocab_chunk_size=10**6), tokens=8, width=300, dtype=torch.float32).vocab_chunk_size == 300
    # "auto": 2**28 bytes of `buffers` float32 [rows, block] buffers; the block, not the shard, over hidden states
    auto = Chunking("auto", vocab_chunk_size=8000, max_chunk_bytes=2**28)
    assert plan(auto, tokens=10, width=32000, dtype=torch.float32, buffers=2).chunk_size == 2**28 // (2 * 4 * 8000)
    assert plan(auto, tokens=10, width=32000, dtype=None, over_logits=True).chunk_size == 2**28 // (2 * 4 * 32000)
    # over given logits: the whole shard, whatever vocab_chunk_size says
    p = plan(Chunking(64, vocab_chunk_size=128), tokens=10**6, width=151936, dtype=None, over_logits=True)
    assert (p.chunk_size, p.vocab_chunk_size, p.grad_vocab_chunk_size) == (64, 151936, None)
    # compiled kernels read a bf16 head's rounded blocks, not with a bias or float32 logits
    kw = dict(tokens=64, width=256, dtype=torch.bfloat16, device=cpu)
    assert walk_plan(Chunking(backend="compile"), **kw).block_dtype == torch.bfloat16
    assert walk_plan(Chunking(backend="compile"), bias=True, **kw).block_dtype is None
    assert walk_plan(Chunking(backend="compile"), float32_logits=True, **kw).block_dtype is None
    assert walk_plan(Chunking(backend="eager"), **kw).block_dtype is None
    # chunked-entropy plan's blocks are the same function's
    assert blocks(Shape(8192, 151936, 4096, dtype="bfloat16"), 1024) == (32768, 4096)
    assert blocks(Shape(8192, 151936, 4096, tp=8), 1024) == (18992, None)
    # bench's methods without chunks (chunk 0): the blocks of one row a chunk
    assert blocks(Shape(256, 512, 16, dtype="bfloat16"), 0) == (512, 512)
