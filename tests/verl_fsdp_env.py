"""verl 0.9.1's real FSDP engine on a CPU, for the tests of the verl FSDP routes: the shims and the fixtures.

Two shims, and only these, stand between verl's ``FSDPEngineWithLMHead`` and
this machine; each says why. Everything else (building the model, FSDP2 over
gloo, the forward, the losses, the optimizer) is verl's own code.

Import this module before anything imports verl's engines (verl computes
its device name at import): :func:`setup` is idempotent and runs on import.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from types import ModuleType
from typing import Any, Optional

import torch

_DONE = False


def setup() -> None:
    """Register and select the CPU platform; keep TRL's missing class from ``apply_monkey_patch``."""
    global _DONE
    if _DONE:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    # Shim 1: verl 0.9.1 registers only accelerator platforms (nvidia, amd, huawei) and falls back to "nvidia"
    # on a host without one, so its engine would move every batch to cuda:0. A CPU platform, registered through
    # verl's own PlatformRegistry and selected with set_platform, is what verl asks a new backend to provide.
    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module: ModuleType = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self):  # verl moves batches with .to(get_device_id()): "cpu" is the device
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):
            import contextlib

            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(PlatformCPU())

    # Shim 2: verl 0.9.1's apply_monkey_patch imports AutoModelForCausalLMWithValueHead from TRL whenever TRL is
    # importable, to patch its state_dict; TRL 1.16 no longer has that class (ImportError, the engine does not
    # build). Its answer to "is TRL available" is made False, so the (value-head only) patch is skipped.
    from verl.models.transformers import monkey_patch

    monkey_patch.is_trl_available = lambda: False
    _DONE = True


def tiny_model_dir(tie: bool, vocab: int = 96, hidden: int = 32, layers: int = 2, seed: int = 0) -> str:
    """A tiny random-weight Qwen2 causal LM saved in a temporary folder (no hub download)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a sharper output distribution than the default init: more telling comparisons
        model.get_output_embeddings().weight.mul_(8.0)
    d = tempfile.mkdtemp(prefix="ce-verl-fsdp-")
    model.save_pretrained(d)
    return d


def build_engine(path: str, *, fused: bool = False, remove_padding: bool = True, chunk: int = 7, sp: int = 1,
                 backend: str = "torch", dtype: str = "fp32"):
    """verl's ``FSDPEngineWithLMHead`` (FSDP2 over gloo; float32, or ``dtype="bf16"``: verl's default mixed
    precision, bf16 parameters under autocast), built with ``initialize()``, in train mode."""
    setup()
    from transformers import Qwen2ForCausalLM
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # verl's apply_monkey_patch sets its fused forward on the model's *class* (process-wide, never undone: verl
    # builds one engine per process); a test that builds several engines in one process puts the class's own
    # forward back before each build, which verl then patches again for a fused engine.
    Qwen2ForCausalLM.forward = _QWEN2_FORWARD
    model_config = HFModelConfig(
        path=path, load_tokenizer=False, use_remove_padding=remove_padding, use_fused_kernels=fused,
        fused_kernel_options={"impl_backend": backend} if fused else {},
        enable_gradient_checkpointing=True,  # verl's default
        override_config={"attn_implementation": "sdpa"},  # verl defaults to flash-attn 2 (CUDA only)
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", use_torch_compile=False, entropy_from_logits_chunk_size=chunk,
        mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ulysses_sequence_parallel_size=sp,
    )
    optimizer_config = FSDPOptimizerConfig(lr=1e-3, clip_grad=1.0, total_training_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = FSDPEngineWithLMHead(model_config, engine_config, optimizer_config, CheckpointConfig())
        engine.initialize()
    engine.train_mode().__enter__()
    engine._test_forward = Qwen2ForCausalLM.forward  # what verl left on the class for this engine (see above)
    return engine


def activate(engine) -> None:
    """Put back on the model's class the forward verl chose for ``engine`` (its fused one, or the class's own)."""
    from transformers import Qwen2ForCausalLM

    Qwen2ForCausalLM.forward = engine._test_forward


def ppo_batch(seed: int, *, vocab: int = 96, k: int = 4, temperature=(0.7, 1.3, 0.9, 1.1), remove_padding=True,
              fused=False, distill=True, entropy=True, sum_pi_squared=False, batch_num_tokens=None, train=False,
              distillation_only=False):
    """A micro-batch as verl's actor hands it to the engine: left/right-padded prompts and responses turned into
    verl's no-padding layout by verl's own ``left_right_2_no_padding``, with advantages, old log-probs and a
    teacher's top-k (ids and log-probs), and the engine's flags. ``temperature``: per sample, or a float."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [4, 3, 2, 4], [5, 3, 4, 2]
    b, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    prompts = torch.randint(3, vocab, (b, p), generator=g)
    responses = torch.randint(3, vocab, (b, r), generator=g)
    mask = torch.zeros(b, p + r, dtype=torch.int64)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        mask[i, p - pl: p + rl] = 1  # prompts left-padded, responses right-padded
        prompts[i, : p - pl] = 2
        responses[i, rl:] = 2
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    response_mask = mask[:, p:].clone()
    teacher_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(b * (p + r))]).view(b, p + r, k)
    teacher_lp = torch.log_softmax(torch.randn(b, p + r, vocab, generator=g) * 2, -1).gather(-1, teacher_ids)
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": mask, "position_ids": position_ids, "response_mask": response_mask,
        "old_log_probs": -torch.rand(b, r, generator=g) * 3, "advantages": torch.randn(b, r, generator=g),
        "teacher_ids": teacher_ids, "teacher_logprobs": teacher_lp,
    }
    if isinstance(temperature, tuple):
        tensors["temperature"] = torch.tensor(temperature, dtype=torch.float32)
    flags = dict(
        use_remove_padding=remove_padding, use_fused_kernels=fused, calculate_entropy=entropy,
        calculate_sum_pi_squared=sum_pi_squared, distillation_use_topk=distill, distillation_only=distillation_only,
        dp_size=1, global_batch_size=None, batch_num_tokens=batch_num_tokens,
    )
    if train:
        flags.update(use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    if not isinstance(temperature, tuple):
        flags["temperature"] = temperature
    td = tu.get_tensordict(tensors, non_tensor_dict=flags)
    return left_right_2_no_padding(td)


def ppo_losses(strategy: str = "fsdp2"):
    """verl's actor loss without distillation: ``partial(ppo_loss, config)`` (policy loss and entropy bonus)."""
    import functools

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actor = FSDPActorConfig(strategy=strategy, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                                rollout_n=1, entropy_coeff=0.01, use_dynamic_bsz=False)
    return functools.partial(ppo_loss, actor)


def losses(strategy: str = "fsdp2", k: int = 4, clamp=-10.0, task_rewards: bool = True):
    """verl's actor loss with top-k distillation: ``partial(distillation_ppo_loss, config, distillation_config)``,
    as verl's engine worker builds it (policy loss, entropy bonus, forward KL over the teacher's top-k)."""
    import functools

    from verl.trainer.distillation import distillation_ppo_loss
    from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actor = FSDPActorConfig(strategy=strategy, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                                rollout_n=1, entropy_coeff=0.01, use_dynamic_bsz=False)
        dcfg = DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=k, log_prob_min_clamp=clamp, use_policy_gradient=False,
            use_task_rewards=task_rewards))
    return functools.partial(distillation_ppo_loss, config=actor, distillation_config=dcfg)


def _qwen2_forward():
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.forward


os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
setup()
_QWEN2_FORWARD = _qwen2_forward()
