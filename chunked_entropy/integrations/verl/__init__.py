"""verl 0.9: every route of verl's output layer through this library, installed at once.

One module per route, each listing what it replaces in verl (its ``TARGETS``):

- :mod:`.megatron`: the Megatron engine's logits processor (the unfused route).
- :mod:`.megatron_fused`: the Megatron engine's fused-kernel route (``use_fused_kernels=True``).
- :mod:`.mtp`: the Megatron engine's MTP heads' losses (``model.mtp.enable_train``).
- :mod:`.fsdp`: the FSDP engine's model outputs (unfused) and verl's fused-kernel classes (fused).

Nothing in verl is edited. Load the patch in every worker with verl's own
hooks: ``VERL_USE_EXTERNAL_MODULES=chunked_entropy.integrations.verl_plugin``
(imported by ``import verl``) or
``actor_rollout_ref.model.external_lib=chunked_entropy.integrations.verl_plugin``.
:func:`install` patches at once the modules verl has imported, the others
as soon as they are (a post-import hook): importing the plugin is cheap and
imports neither verl's engines nor megatron-core.

Tested with verl 0.9.1 and megatron-core 0.16.1.
"""

from __future__ import annotations

from .._common import Adapter, Patch
from . import fsdp, megatron, megatron_fused, mtp
from .megatron import TARGET_MODULE, lm_head_logits_processor

__all__ = ["TARGET_MODULE", "install", "installed", "lm_head_logits_processor", "uninstall"]

_PATCH = Patch(
    "verl",
    [*megatron.TARGETS, *megatron_fused.TARGETS, *mtp.TARGETS, *fsdp.TARGETS],
    "verl's MegatronEngineWithLMHead._lm_head_logits_processor now computes log-probs, entropy and "
    "sum_pi_squared chunked, without div_ or clone (chunk size: entropy_from_logits_chunk_size); its fused route "
    "(use_fused_kernels=True) runs chunked_entropy's fused head: per-token temperature, sum_pi_squared, top-k "
    "distillation keys; its MTP heads' losses come from the fused head too; FSDPEngineWithLMHead's outputs and "
    "verl's fused kernels (FusedLinearForPPO, linear_cross_entropy) come from chunked_entropy",
)


_ADAPTER = Adapter(_PATCH)


def install() -> None:
    """Make verl compute its output layer with this library, on every route (once; idempotent).

    Checks every route's targets in the verl modules already imported, then
    (only if all pass) replaces them; the others are replaced as soon as
    their modules are imported. Raises RuntimeError, leaving verl as it was,
    when a verl function does not have verl 0.9's signature.
    """
    _ADAPTER.install()


def uninstall() -> None:
    """Restore verl's own functions (and drop a pending post-import hook)."""
    _ADAPTER.uninstall()


def installed() -> bool:
    """Whether any of the framework's functions is currently replaced."""
    return _ADAPTER.installed()
