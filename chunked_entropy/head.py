"""``ChunkedVocabParallelHead``: the output layer users wrap; it stores options and dispatches.

Layer: the module (the top): an ``nn.Module`` over the ops below it, the fused
head (:func:`~chunked_entropy.linear_log_probs_and_entropy`) and the fused
policy loss (:func:`~chunked_entropy.linear_policy_loss`). It holds an
:class:`~chunked_entropy.OutputLayer` and a :class:`~chunked_entropy.Chunking`,
no math of its own, and knows no framework: ``from_hf_model`` finds the
Hugging Face reader an adapter registers (see
:meth:`ChunkedVocabParallelHead.from_hf_model`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Union

import torch
from torch import nn

from ._migrate import REMOVED_IN, accepts_01_keywords
from .linear import LogProbsEntropy, linear_log_probs_and_entropy
from .options import READERS, Chunking, OutputLayer, as_chunking, as_layer, model_reader
from .policy import linear_policy_loss

__all__ = ["READERS", "ChunkedVocabParallelHead", "model_reader"]

_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(OutputLayer))
_CHUNKING_FIELDS = tuple(f.name for f in dataclasses.fields(Chunking))


class ChunkedVocabParallelHead(nn.Module):
    """An output layer that returns log-probs and entropy instead of logits.

    Holds an :class:`~chunked_entropy.OutputLayer` (the weight and bias of an
    lm_head, a Megatron ``ColumnParallelLinear`` output layer or a tied
    embedding, with its logit transform, group and dtype settings) and a
    :class:`~chunked_entropy.Chunking`; ``forward(hidden, labels)`` calls
    :func:`linear_log_probs_and_entropy` with them. The parameters are
    shared, not copied: training the head trains the original layer.

    Example:
        >>> lm_head = torch.nn.Linear(16, 50, bias=False)
        >>> head = ChunkedVocabParallelHead.from_linear(lm_head, chunking=256)
        >>> hidden = torch.randn(2, 7, 16, requires_grad=True)
        >>> labels = torch.randint(0, 50, (2, 7))
        >>> log_probs, entropy = head(hidden, labels)
    """

    @accepts_01_keywords("ChunkedVocabParallelHead", old_bias_position=2)
    def __init__(self, layer: Union[OutputLayer, torch.Tensor], chunking: Union[Chunking, int, None] = None):
        super().__init__()
        self._layer = as_layer(layer)
        self.chunking = as_chunking(chunking, invariant_ok=True)
        if self._layer.weight is None:
            raise ValueError("layer must hold a weight (the head computes the logits from hidden states)")
        self.weight = self._layer.weight  # registered as the head's parameter when it is one
        self.bias = self._layer.bias

    @property
    def layer(self) -> OutputLayer:
        """The output layer, over the head's current weight and bias (``.to()`` may have replaced them)."""
        if self._layer.weight is self.weight and self._layer.bias is self.bias:
            return self._layer
        return self._layer.replace(weight=self.weight, bias=self.bias)

    def __getattr__(self, name):  # 0.1's attributes: head.chunk_size, head.softcap, ...
        if name in _CHUNKING_FIELDS:
            return getattr(self.chunking, name)
        if name in _LAYER_FIELDS and name not in ("weight", "bias") and "_layer" in self.__dict__:
            return getattr(self.__dict__["_layer"], name)
        return super().__getattr__(name)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature=1.0,
        compute_entropy: bool = True,
        label_mask: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        compute_sum_pi_squared: bool = False,
        keep=None,
        entropy_of: str = "full",
        log_probs_at: Optional[torch.Tensor] = None,
        top_k: Optional[int] = None,
        rows=None,
    ) -> LogProbsEntropy:
        """:func:`linear_log_probs_and_entropy` with this head's layer and chunking.

        ``keep`` (the rollout's kept sets, for sampling replay), ``entropy_of``,
        ``log_probs_at`` and ``top_k`` (distillation) are as in
        :func:`~chunked_entropy.log_probs_and_entropy`; ``labels`` may be None
        with the last two. ``rows`` (project only those rows: an int64 index
        into the flattened token rows, or ``"kept"``) is as in
        :func:`~chunked_entropy.linear_log_probs_and_entropy`.
        """
        return linear_log_probs_and_entropy(
            hidden, self.layer, labels, chunking=self.chunking, temperature=temperature,
            compute_entropy=compute_entropy, label_mask=label_mask, ignore_index=ignore_index,
            compute_sum_pi_squared=compute_sum_pi_squared, keep=keep, entropy_of=entropy_of,
            log_probs_at=log_probs_at, top_k=top_k, rows=rows,
        )

    def policy_loss(self, hidden: torch.Tensor, labels: torch.Tensor, old_log_probs, advantages, loss_mask, **kw):
        """:func:`~chunked_entropy.linear_policy_loss` with this head's layer and chunking: ``(loss, metrics)``.

        Keywords are those of :func:`~chunked_entropy.linear_policy_loss`
        (``loss=PolicyLoss(...)``, ``temperature``, ``ref_log_probs``, ``keep``, ...); ``chunking=`` overrides
        the head's for this call (None: the head's).
        """
        layer, chunking = self.layer, kw.pop("chunking", None)
        chunking = self.chunking if chunking is None else chunking
        old_layer = {k: kw.pop(k) for k in _LAYER_FIELDS if k in kw}
        old_chunking = {k: kw.pop(k) for k in _CHUNKING_FIELDS if k in kw}
        if old_layer or old_chunking:  # 0.1 took the head's settings here too
            names = ", ".join(sorted({**old_layer, **old_chunking}))
            warnings.warn(
                f"ChunkedVocabParallelHead.policy_loss: the keyword(s) {names} are 0.1's and go in {REMOVED_IN}; "
                "build the head with those settings (OutputLayer, Chunking), or pass chunking=Chunking(...)",
                DeprecationWarning, stacklevel=2)
            layer = layer.replace(**old_layer)
            chunking = as_chunking(chunking).replace(**old_chunking)
        return linear_policy_loss(hidden, layer, labels, old_log_probs, advantages, loss_mask, chunking=chunking,
                                  **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, chunking=None, **changes) -> "ChunkedVocabParallelHead":
        """Wrap a ``torch.nn.Linear`` lm_head (e.g. a Hugging Face model's); its parameters are shared.
        ``changes`` set the layer's other fields (:meth:`OutputLayer.from_linear`)."""
        layer_fields = {k: changes.pop(k) for k in list(changes) if k in _LAYER_FIELDS}
        return cls(OutputLayer.from_linear(linear, **layer_fields), chunking=chunking, **changes)

    @classmethod
    def from_hf_model(cls, model, *, verify: bool = True, **kw) -> "ChunkedVocabParallelHead":
        """Wrap a Hugging Face causal LM's output layer, with the logit transform its config names.

        The head knows no framework: the reading is done by the Hugging Face
        adapter, :func:`chunked_entropy.integrations.huggingface.head_from_model`,
        which this package registers as the ``huggingface`` reader of the
        ``chunked_entropy.model_readers`` entry-point group. It reads Gemma
        2/3's ``final_logit_softcapping``, Cohere's ``logit_scale`` and
        Granite's ``logits_scaling`` from the config (each only for the
        architectures that apply it), and checks the head against a two-token
        forward of the model (``verify``), so an unknown transform raises
        instead of giving other log-probs. ``kw``: ``chunking=`` and the
        layer's fields.
        """
        return model_reader("huggingface")(model, verify=verify, **kw)

    @classmethod
    def from_megatron(cls, output_layer, *, weight: Optional[torch.Tensor] = None, chunking=None,
                      **changes) -> "ChunkedVocabParallelHead":
        """Wrap a megatron-core ``ColumnParallelLinear`` output layer (:meth:`OutputLayer.from_megatron`:
        its weight or ``weight=``, bias, group, ``sequence_parallel``, ``gradient_accumulation_fusion``);
        ``changes`` override the layer's fields."""
        layer_fields = {k: changes.pop(k) for k in list(changes) if k in _LAYER_FIELDS}
        return cls(OutputLayer.from_megatron(output_layer, weight=weight, **layer_fields), chunking=chunking,
                   **changes)

    def extra_repr(self) -> str:
        layer, c = self.layer, self.chunking
        v, h = layer.weight.shape
        return (
            f"V_local={v}, H={h}, bias={layer.bias is not None}, chunk_size={c.chunk_size}, "
            f"vocab_chunk_size={c.vocab_chunk_size}, sequence_parallel={layer.sequence_parallel}"
            + (f", softcap={layer.softcap}" if layer.softcap is not None else "")
            + (f", logit_scale={layer.logit_scale}" if layer.logit_scale is not None else "")
            + (f", logits_dtype={layer.logits_dtype}" if layer.logits_dtype is not None else "")
        )
