"""Names ``openrlhf.models.ring_attn_utils`` imports; calling one is an error (see the package docstring)."""


def _unavailable(*args, **kwargs):
    raise RuntimeError("flash_attn stand-in: packed samples need the real flash-attn")


index_first_axis = pad_input = rearrange = unpad_input = _unavailable
