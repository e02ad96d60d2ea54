"""Loading a checkpoint: what the GGUF conversion may and may not change."""

from __future__ import annotations

from pathlib import Path

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


def test_the_conversion_draws_no_progress_bar_of_transformers(capsys):
    """transformers' GGUF loader draws its own tqdm bar over the tensors, which `disable_progress_bar` does not
    reach: a `--json` run's stderr got it. While converting it draws nothing; afterwards it is transformers' own."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    original = hf_gguf.tqdm
    with _gguf_parsed_once():
        assert list(hf_gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")) == [0, 1, 2]
    assert "Converting" not in capsys.readouterr().err
    assert hf_gguf.tqdm is original
    list(hf_gguf.tqdm(range(3), desc="drawn"))
    assert "drawn" in capsys.readouterr().err  # the check above could see a bar


def test_the_conversion_reader_reads_what_ggufs_own_reader_reads(tmp_path):
    """The conversion's reader slices a plain view of the file's memory map (3x faster on a 262k-entry
    vocabulary): every field's parts, types and data indices, and every tensor, equal gguf's own reader's."""
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_string("general.name", "tiny ü")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "▁the", "é", "", "x" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 3.0, 0.5])
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3, 1, 6])
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_tensor("token_embd.weight", np.arange(40, dtype=np.float32).reshape(5, 8))
    writer.add_tensor("output_norm.weight", np.linspace(-1, 1, 8, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = gguf.GGUFReader(path)
    with _gguf_parsed_once():
        read = gguf.GGUFReader(path)
    assert type(read) is not gguf.GGUFReader and list(read.fields) == list(expected.fields)
    for name, field in expected.fields.items():
        got = read.fields[name]
        assert (got.offset, got.data, got.types) == (field.offset, field.data, field.types), name
        assert len(got.parts) == len(field.parts), name
        for a, b in zip(got.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in read.tensors] == [t.name for t in expected.tensors]
    for got, tensor in zip(read.tensors, expected.tensors):
        assert got.tensor_type == tensor.tensor_type and np.array_equal(got.data, tensor.data)
        assert got.data.dtype == tensor.data.dtype and got.data.shape == tensor.data.shape
    # and transformers' value parser, which kvblend's replaces while converting, reads every field alike
    from transformers.integrations.ggml import _gguf_parse_value

    from kvblend.model.loading import _fast_parse_value

    for name, field in expected.fields.items():
        theirs = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        ours = [_fast_parse_value(field.parts[i], field.types) for i in field.data]
        assert ours == theirs and [type(v) for v in ours] == [type(v) for v in theirs], name
    with _gguf_parsed_once():
        from transformers import modeling_gguf_pytorch_utils

        assert modeling_gguf_pytorch_utils._gguf_parse_value is _fast_parse_value
    assert modeling_gguf_pytorch_utils._gguf_parse_value is _gguf_parse_value  # put back afterwards


def test_the_architecture_is_read_from_a_gguf_header_alone(tmp_path):
    """An unsupported family is refused from the header in milliseconds (a full parse of Gemma 3's took 16 s)."""
    import pytest

    from kvblend.errors import ModelNotFoundError, UnsupportedModelError
    from kvblend.model.source import check_gguf_architecture, gguf_architecture

    def write(name: str, arch: str) -> Path:
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_string("general.name", "x" * 100)
        writer.add_array("general.tags", ["a", "b"])
        writer.add_block_count(3)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return path

    assert gguf_architecture(write("g.gguf", "gemma3")) == "gemma3"
    with pytest.raises(ModelNotFoundError, match="holds no weights"):
        check_gguf_architecture(write("l.gguf", "llama"))  # supported, but a header with no tensors
    with pytest.raises(UnsupportedModelError, match="unsupported architecture gemma2 .*Gemma3ForCausalLM"):
        check_gguf_architecture(write("g2.gguf", "gemma2"))
    with pytest.raises(UnsupportedModelError, match="Phi-3 is read from a checkpoint directory"):
        check_gguf_architecture(write("p.gguf", "phi3"))  # its GGUF conversion loses the RoPE settings
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        gguf_architecture(bad)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(write("t.gguf", "qwen3").read_bytes()[:30])
    with pytest.raises(ModelNotFoundError, match="truncated GGUF header"):
        gguf_architecture(truncated)


def _tiny_llama_gguf(path: Path, drop: str = "") -> Path:
    """A 2-layer Llama GGUF of random weights and a 32-token vocabulary, the tensors whose names start with
    `drop` left out (the weights are checked before the tokenizer is converted, so it needs no merges)."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    H, F, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 32
    writer.add_block_count(layers)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(F)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(H // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,)}
    for i in range(layers):
        tensors |= {f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                    f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (H // heads * kv_heads, H),
                    f"blk.{i}.attn_v.weight": (H // heads * kv_heads, H), f"blk.{i}.attn_output.weight": (H, H),
                    f"blk.{i}.ffn_gate.weight": (F, H), f"blk.{i}.ffn_up.weight": (F, H),
                    f"blk.{i}.ffn_down.weight": (H, F)}
    for name, shape in tensors.items():
        if not (drop and name.startswith(drop)):
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_without_all_its_weights_is_refused_not_filled_with_random_ones(tmp_path, monkeypatch):
    """transformers fills the weights a GGUF lacks with random ones and says so in a warning kvblend silences: a
    vocabulary-only file, the first part of a split model, or a file missing a layer loaded and answered
    gibberish (and a header with neither weights nor architecture built a 27 GB default Llama first)."""
    import pytest

    from kvblend.errors import ModelNotFoundError
    from kvblend.model.loading import load_model

    monkeypatch.setenv("KVBLEND_MODEL_CACHE", str(tmp_path / "cache"))
    cut = _tiny_llama_gguf(tmp_path / "cut.gguf", drop="blk.1.")
    with pytest.raises(ModelNotFoundError, match=r"lacks 9 of the model's weights \(e\.g\. model\.layers\.1\."):
        load_model(str(cut), compute="cpu")
    assert not any((tmp_path / "cache").glob("*/config.json"))  # nothing converted is kept
    empty = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(empty), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelNotFoundError, match="holds no weights"):
        load_model(str(empty), compute="cpu")
    part = tmp_path / "model-00001-of-00003.gguf"
    part.write_bytes(cut.read_bytes())
    with pytest.raises(ModelNotFoundError, match="one part of a split GGUF"):
        load_model(str(part), compute="cpu")


def test_model_paths_that_are_no_model_are_one_line(tmp_path):
    """A dangling weights link (an interrupted Hugging Face download) was a FileNotFoundError traceback; a file
    that exists but is no .gguf said "no model at"; MODEL.GGUF was not a GGUF; and a vocabulary of more than
    65,536 strings before the architecture made a valid header read as damaged."""
    import json

    import pytest

    from kvblend.errors import ModelNotFoundError
    from kvblend.model.source import gguf_architecture, resolve_model_source, source_fingerprint

    folder = tmp_path / "snapshot"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").symlink_to(tmp_path / "blobs" / "abc123")
    with pytest.raises(ModelNotFoundError, match=r"cannot read .*model\.safetensors"):
        source_fingerprint(resolve_model_source(str(folder)))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="is not a .gguf file"):
        resolve_model_source(str(tmp_path / "notes.txt"))
    import struct

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    tokens = [f"t{i}" for i in range(70_000)]  # the vocabulary first, then the architecture (GGUF v3, by hand)
    upper = tmp_path / "MODEL.GGUF"
    upper.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
                      + text("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(tokens))
                      + b"".join(text(t) for t in tokens)
                      + text("general.architecture") + struct.pack("<I", 8) + text("qwen3"))
    assert resolve_model_source(str(upper)).gguf_file == "MODEL.GGUF"
    assert gguf_architecture(upper) == "qwen3"
