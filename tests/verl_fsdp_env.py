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
        model.get_output_embeddings().weight.mul_(40.0)
    d = tempfile.mkdtemp(prefix="ce-verl-fsdp-")
    model.save_pretrained(d)
    return d


def build_engine(path: str, *, fused: bool = False, remove_padding: bool = True, chunk: int = 7, sp: int = 1):
    """verl's ``FSDPEngineWithLMHead`` (FSDP2, float32, gloo), built with ``initialize()``, in train mode."""
    setup()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from transformers import Qwen2ForCausalLM

    # verl's apply_monkey_patch sets its fused forward on the model's *class* (process-wide, never undone: verl
    # builds one engine per process); a test that builds several engines in one process puts the class's own
    # forward back before each build, which verl then patches again for a fused engine.
    Qwen2ForCausalLM.forward = _QWEN2_FORWARD
    model_config = HFModelConfig(
        path=path, load_tokenizer=False, use_remove_padding=remove_padding, use_fused_kernels=fused,
        fused_kernel_options={"impl_backend": "torch"} if fused else {}, enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "sdpa"},  # verl defaults to flash-attn 2 (CUDA only)
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", use_torch_compile=False, entropy_from_logits_chunk_size=chunk,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ulysses_sequence_parallel_size=sp,
    )
    optimizer_config = FSDPOptimizerConfig(lr=1e-3, clip_grad=1.0, total_training_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = FSDPEngineWithLMHead(model_config, engine_config, optimizer_config, CheckpointConfig())
        engine.initialize()
    engine.train_mode().__enter__()
    return engine


def _qwen2_forward():
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.forward


os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
setup()
_QWEN2_FORWARD = _qwen2_forward()
