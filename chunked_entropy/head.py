"""``ChunkedVocabParallelHead``: the output layer users wrap; it stores options and dispatches.

Floor 5 (the top): an ``nn.Module`` over the ops below it, the fused head
(:func:`~chunked_entropy.linear_log_probs_and_entropy`) and the fused policy
loss (:func:`~chunked_entropy.linear_policy_loss`). It holds no math of its
own and knows no framework: ``from_hf_model`` finds the Hugging Face reader
an adapter registers (see :meth:`ChunkedVocabParallelHead.from_hf_model`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ._blocks import check_logits_dtype
from ._checks import check_chunk, check_flag, check_float
from ._kernels import check_backend
from ._outputs import LogProbsEntropy
from ._stats import Transform
from .linear import linear_log_probs_and_entropy
from .parallel import group_rank_size
from .policy import linear_policy_loss

__all__ = ["ChunkedVocabParallelHead", "model_reader"]

#: The entry-point group through which adapters supply the readers of other frameworks' models.
READERS = "chunked_entropy.model_readers"


def model_reader(name: str):
    """The model reader registered under ``name`` in the :data:`READERS` entry-point group.

    A reader is ``reader(model, **kw) -> ChunkedVocabParallelHead``. This
    package registers ``huggingface``; another package can register its own
    in its metadata (``[options.entry_points]`` of its ``setup.cfg``).
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group=READERS):
        if ep.name == name:
            return ep.load()
    raise RuntimeError(
        f"no {name!r} model reader is registered in the {READERS!r} entry points: is chunked_entropy installed "
        "(pip install -e .)? Without the package metadata, call "
        "chunked_entropy.integrations.huggingface.head_from_model(model) directly"
    )


class ChunkedVocabParallelHead(nn.Module):
    """An output layer that returns log-probs and entropy instead of logits.

    Wraps the weight (and bias) of an lm_head, a Megatron ``ColumnParallelLinear``
    output layer or a tied embedding; ``forward(hidden, labels)`` calls
    :func:`linear_log_probs_and_entropy`. The parameters are shared, not
    copied: training the head trains the original layer. ``softcap`` and
    ``logit_scale`` are the model's logit transform (see
    :func:`~chunked_entropy.log_probs_and_entropy`), fixed per head,
    ``backend`` chooses the per-block kernels (``"auto"``, ``"eager"``,
    ``"compile"``, ``"triton"``; see :func:`~chunked_entropy.log_probs_and_entropy`), and
    ``logits_dtype=torch.float32`` keeps a bf16/fp16 head's matmuls in float32
    (see :func:`linear_log_probs_and_entropy`; the default rounds the logits to
    the weight's dtype, as the model's own layer and a vLLM rollout do).

    Example:
        >>> lm_head = torch.nn.Linear(16, 50, bias=False)
        >>> head = ChunkedVocabParallelHead.from_linear(lm_head, chunk_size=256)
        >>> hidden = torch.randn(2, 7, 16, requires_grad=True)
        >>> labels = torch.randint(0, 50, (2, 7))
        >>> log_probs, entropy = head(hidden, labels)
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        chunk_size: int = 1024,
        process_group=None,
        sequence_parallel: bool = False,
        vocab_chunk_size: Optional[int] = None,
        gradient_accumulation_fusion: Optional[bool] = None,
        softcap: Optional[float] = None,
        logit_scale: Optional[float] = None,
        backend: str = "auto",
        logits_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        check_float("weight", weight, dim=2)
        if bias is not None:
            check_float("bias", bias)
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"bias must have shape ({weight.shape[0]},) (V_local), got {tuple(bias.shape)}")
        check_chunk("chunk_size", chunk_size)
        check_chunk("vocab_chunk_size", vocab_chunk_size, optional=True)
        group_rank_size(process_group)  # a clear error now if the group is unusable
        tf = Transform(softcap, logit_scale)  # checked now
        self.softcap, self.logit_scale = tf.softcap, tf.logit_scale
        self.backend = check_backend(backend)
        self.weight = weight
        self.bias = bias
        self.chunk_size = chunk_size
        self.process_group = process_group
        self.sequence_parallel = check_flag("sequence_parallel", sequence_parallel)
        self.vocab_chunk_size = vocab_chunk_size
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        check_logits_dtype(logits_dtype, weight)
        self.logits_dtype = logits_dtype

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
        """:func:`linear_log_probs_and_entropy` with this head's weight, bias and settings.

        ``keep`` (the rollout's kept sets, for sampling replay), ``entropy_of``,
        ``log_probs_at`` and ``top_k`` (distillation) are as in
        :func:`~chunked_entropy.log_probs_and_entropy`; ``labels`` may be None
        with the last two. ``rows`` (project only those rows: an int64 index
        into the flattened token rows, or ``"kept"``) is as in
        :func:`~chunked_entropy.linear_log_probs_and_entropy`.
        """
        return linear_log_probs_and_entropy(
            hidden, self.weight, labels, bias=self.bias, chunk_size=self.chunk_size,
            temperature=temperature, process_group=self.process_group,
            sequence_parallel=self.sequence_parallel, compute_entropy=compute_entropy,
            label_mask=label_mask, ignore_index=ignore_index,
            vocab_chunk_size=self.vocab_chunk_size,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            softcap=self.softcap, logit_scale=self.logit_scale,
            compute_sum_pi_squared=compute_sum_pi_squared, backend=self.backend, keep=keep, entropy_of=entropy_of,
            logits_dtype=self.logits_dtype, log_probs_at=log_probs_at, top_k=top_k, rows=rows,
        )

    def policy_loss(self, hidden: torch.Tensor, labels: torch.Tensor, old_log_probs, advantages, loss_mask, **kw):
        """:func:`~chunked_entropy.linear_policy_loss` with this head's weight, bias and settings: ``(loss, metrics)``.

        Keywords are those of :func:`~chunked_entropy.linear_policy_loss`
        (the loss options, ``temperature``, ``ref_log_probs``, ``keep``, ``entropy_of``).
        """
        for key, value in (("bias", self.bias), ("chunk_size", self.chunk_size), ("process_group", self.process_group),
                           ("sequence_parallel", self.sequence_parallel), ("vocab_chunk_size", self.vocab_chunk_size),
                           ("gradient_accumulation_fusion", self.gradient_accumulation_fusion),
                           ("softcap", self.softcap), ("logit_scale", self.logit_scale), ("backend", self.backend),
                           ("logits_dtype", self.logits_dtype)):
            kw.setdefault(key, value)
        return linear_policy_loss(hidden, self.weight, labels, old_log_probs, advantages, loss_mask, **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "ChunkedVocabParallelHead":
        """Wrap a ``torch.nn.Linear`` lm_head (e.g. a Hugging Face model's); its parameters are shared."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias, **kw)

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
        instead of giving other log-probs.
        """
        return model_reader("huggingface")(model, verify=verify, **kw)

    @classmethod
    def from_megatron(cls, output_layer, *, weight: Optional[torch.Tensor] = None, **kw) -> "ChunkedVocabParallelHead":
        """Wrap a megatron-core ``ColumnParallelLinear`` output layer.

        Takes its weight (or ``weight=``, the tied embedding weight, required
        when the layer was built with ``skip_weight_param_allocation``), its
        bias (unless ``skip_bias_add``), its tensor-parallel group,
        ``sequence_parallel`` and ``gradient_accumulation_fusion``. Keyword
        arguments override these, and pass ``chunk_size`` etc.
        """
        for attr in ("tp_group", "sequence_parallel"):
            if not hasattr(output_layer, attr):
                raise TypeError(
                    f"output_layer must be a megatron-core ColumnParallelLinear (missing .{attr}), "
                    f"got {type(output_layer).__name__}"
                )
        if weight is None:
            weight = output_layer.weight
            if weight is None:
                raise ValueError(
                    "output_layer has no weight (skip_weight_param_allocation, tied embeddings): pass "
                    "weight=model.shared_embedding_or_output_weight()"
                )
        bias = None if getattr(output_layer, "skip_bias_add", False) else getattr(output_layer, "bias", None)
        kw.setdefault("process_group", output_layer.tp_group)
        kw.setdefault("sequence_parallel", output_layer.sequence_parallel)
        if getattr(output_layer, "gradient_accumulation_fusion", False):
            kw.setdefault("gradient_accumulation_fusion", True)
        else:
            kw.setdefault("gradient_accumulation_fusion", False)
        return cls(weight, bias, **kw)

    def extra_repr(self) -> str:
        v, h = self.weight.shape
        return (
            f"V_local={v}, H={h}, bias={self.bias is not None}, chunk_size={self.chunk_size}, "
            f"vocab_chunk_size={self.vocab_chunk_size}, sequence_parallel={self.sequence_parallel}"
            + (f", softcap={self.softcap}" if self.softcap is not None else "")
            + (f", logit_scale={self.logit_scale}" if self.logit_scale is not None else "")
            + (f", logits_dtype={self.logits_dtype}" if self.logits_dtype is not None else "")
        )
