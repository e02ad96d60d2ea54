"""Loading a checkpoint: what the GGUF conversion may and may not change."""

from __future__ import annotations

import gguf

from kvblend.model.loading import _gguf_parsed_once


def test_the_conversion_parses_once_and_leaves_gguf_as_it_was():
    """While converting, the file's parse and each tensor-name map are built once and shared (they were built
    three and ~400 times); afterwards gguf's own functions are back, building anew on every call."""
    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with _gguf_parsed_once():
        first = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is first
        assert gguf.get_tensor_name_map(arch, 2) is not first  # other arguments, another map
        assert first.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"  # the map itself unchanged
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
    assert gguf.get_tensor_name_map(arch, 30) is not gguf.get_tensor_name_map(arch, 30)
