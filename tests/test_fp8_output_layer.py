"""megatron-core >= 0.19's MXFP8 output layer (``TransformerConfig.fp8_output_proj``): refused by the adapters that
would compute it in bf16 with the fused head, with an error saying what to do.

megatron-core 0.19 builds the output layer of a config with ``fp8_output_proj=True`` (validated to come with
``fp8`` set and ``fp8_recipe='mxfp8'``) as Transformer Engine's ``TELMHeadColumnParallelLinear`` and runs it under
the MXFP8 autocast (``megatron/core/models/gpt/gpt_model.py`` and ``fp8_utils.is_mxfp8_output_proj_active`` at
core_v0.19.0). megatron-core 0.19 needs Python >= 3.12 and Transformer Engine a GPU; the installed 0.16.1 has no
such field. So the tests build **a real 0.16.1 ``TransformerConfig`` subclass carrying the 0.19 field** (a
dataclass field of the same name and default, set with ``fp8='e4m3'`` and ``fp8_recipe='mxfp8'`` as 0.19 requires)
and a real ``GPTModel`` from it; without Transformer Engine its output layer is 0.16.1's ``ColumnParallelLinear``,
which is exactly the silent case: every adapter would have served it in bf16 from the weight without a word.

Covered: megatron's ``enable_fused_log_probs``, the slime and Miles plugins (at install from Megatron's
``--fp8-output-proj`` argument, and on the hidden-state route from the model's config when the arguments do not
carry it), verl's Megatron fused route, and the shared head builder every Megatron route uses. The logits routes
(megatron-core's own MXFP8 logits, read chunked) still serve such a model. TP 2 over gloo: every rank refuses.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from tests.helpers import require, run_distributed

require("megatron.core", "verl")

from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from chunked_entropy.integrations import _common, _hidden_route  # noqa: E402
from chunked_entropy.integrations import miles as ce_miles  # noqa: E402
from chunked_entropy.integrations import slime as ce_slime  # noqa: E402


@dataclasses.dataclass
class Config019(TransformerConfig):
    """megatron-core 0.16.1's TransformerConfig carrying 0.19's field (same name, type and default)."""

    fp8_output_proj: bool = False


FP8_HEAD = dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_output_proj=True)
NAMED = r"fp8_output_proj is set \(megatron-core >= 0.19\)"


def _config(**fields):
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return Config019(**base, **fields)


def test_detection_reads_the_019_field_and_the_te_class():
    assert _common.fp8_output_layer(_config(**FP8_HEAD))
    assert not _common.fp8_output_layer(_config())  # the field present and False
    assert not _common.fp8_output_layer(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2))
    assert not _common.fp8_output_layer(None, None)

    class TELMHeadColumnParallelLinear(torch.nn.Module):  # Transformer Engine (CUDA only) is not installed here:
        config = None                                    # the class is told by its name, as the adapters read it

    assert _common.fp8_output_layer(None, TELMHeadColumnParallelLinear())
    with pytest.raises(ValueError, match=NAMED + ".*do this instead"):
        _common.refuse_fp8_output_layer(_config(**FP8_HEAD), advice="do this instead")


@pytest.mark.parametrize("plugin,env", [(ce_slime, "CHUNKED_ENTROPY_SLIME_ROUTE"),
                                        (ce_miles, "CHUNKED_ENTROPY_MILES_ROUTE")])
def test_slime_and_miles_refuse_the_hidden_route_at_install(plugin, env, monkeypatch):
    monkeypatch.delenv(env, raising=False)
    args = argparse.Namespace(fp8_output_proj=True)  # Megatron 0.19's --fp8-output-proj
    for route in (None, "hidden"):
        with pytest.raises(ValueError, match=rf"args.fp8_output_proj is set.*route='logits' \({env}=logits\)"):
            plugin.install(args, route=route)
        assert not plugin.installed() and plugin.route() is None  # nothing patched
    try:
        plugin.install(args, route="logits")  # megatron-core's own MXFP8 logits, read chunked: served
        assert plugin.route() == "logits"
        plugin.install(argparse.Namespace(fp8_output_proj=False), route="hidden")  # the bf16 head: served
        assert plugin.route() == "hidden"
    finally:
        plugin.uninstall()


def _inputs(v, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, v, (1, n), generator=g), position_ids=torch.arange(n)[None],
                attention_mask=None, labels=None)


def _worker(rank, world):
    from megatron.core import parallel_state

    from chunked_entropy.integrations import verl as ce_verl
    from chunked_entropy.integrations.megatron import enable_fused_log_probs
    from chunked_entropy.options import Chunking
    from tests import verl_engine as ve

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        with ve.cpu_only_replacements():
            model = ve.gpt_model(world, tied=False, seed=3, config_class=Config019, config_fields=FP8_HEAD)
            assert model.config.fp8_output_proj and model.output_layer.config.fp8_output_proj

            # megatron: refused before the model is touched
            with pytest.raises(ValueError, match=NAMED + ".*without labels.*log_probs_and_entropy"):
                enable_fused_log_probs(model)
            assert "forward" not in model.__dict__ and "_postprocess" not in model.__dict__

            # the shared head builder (slime, Miles, verl's fused and MTP heads): refused
            with pytest.raises(ValueError, match=NAMED + ".*logits route"):
                _common.MegatronHeads().head(model.output_layer, chunking=Chunking(4))

            # slime's hidden-state route with arguments that do not carry the flag: refused at the model's call
            kw = _inputs(ve.V)
            ce_slime.install(argparse.Namespace(), route="hidden")
            try:
                with pytest.raises(ValueError, match=NAMED + ".*Install the slime plugin with route='logits'"):
                    model(**kw)
            finally:
                ce_slime.uninstall()
            ce_slime.install(argparse.Namespace(), route="logits")  # the logits route: megatron-core's own logits
            try:
                logits = model(**kw)
                assert isinstance(logits, torch.Tensor) and logits.shape == (1, 8, ve.V // world)
            finally:
                ce_slime.uninstall()

            # verl's Megatron fused route: refused, pointing at the unfused route
            ce_verl.install()
            try:
                eng = ve.engine(model, fused=True)
                data = ve.batch([5, 7], seed=2, temperatures=[1.0, 0.7], flags=dict(calculate_entropy=True))
                with pytest.raises(ValueError, match=NAMED + ".*use_fused_kernels=False"):
                    ve.forward(eng, model, data)
                # such a model on verl's unfused route: served (its logits are the model's); a fresh one, as verl's
                # patch_fused_forward bound the fused forward to the first
                model = ve.gpt_model(world, tied=False, seed=3, config_class=Config019, config_fields=FP8_HEAD)
                out = ve.forward(ve.engine(model, fused=False), model, data)
                assert out["log_probs"].values().isfinite().all()
            finally:
                ce_verl.uninstall()
    finally:
        parallel_state.destroy_model_parallel()
        _hidden_route._HEADS._held.clear()


def test_every_megatron_route_refuses_an_mxfp8_output_layer_tp2():
    run_distributed(_worker, 2, timeout_s=120)
