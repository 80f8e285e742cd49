"""Names ``openrlhf.models.ring_attn_utils`` imports; calling one is an error (see the package docstring)."""

from ..bert_padding import _unavailable

all_gather = _unavailable
