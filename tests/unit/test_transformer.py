"""kvblend's own modules and config reader against transformers', on tiny random models of every family.

The runner runs kvblend.model.transformer's modules, not transformers'; these tests hold them to
transformers op for op (norms, projections, MLP, rotary tables, Gemma's scaled embedding), and hold
the config reader to both spellings transformers has written (v5 `rope_parameters`, v4 `rope_theta` +
`rope_scaling`). The whole forward pass is compared in test_runner.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from support import ARCHS, native_model, tiny_reference
from kvblend.errors import ModelNotFoundError, UnsupportedModelError
from kvblend.model.config import FULL, SLIDING, ModelConfig
from kvblend.model.transformer import Transformer, read_safetensors


@pytest.fixture(params=ARCHS)
def pair(request):
    reference = tiny_reference(request.param, seed=3)
    return native_model(reference), reference


@torch.inference_mode()
def test_every_module_computes_what_transformers_computes(pair):
    ours, theirs = pair
    x = torch.randn(2, 9, ours.config.hidden_size)
    ids = torch.randint(0, ours.config.vocab_size, (2, 9))
    assert torch.equal(ours.model.embed_tokens(ids), theirs.model.embed_tokens(ids))
    fused = hasattr(theirs.model.layers[0].self_attn, "qkv_proj")  # Phi-3: kvblend splits it at load
    same = (lambda a, b: torch.allclose(a, b, atol=1e-6)) if fused else torch.equal  # a split matmul rounds apart
    for mine, ref in zip(ours.model.layers, theirs.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp"):
            if hasattr(ref, name):
                assert same(getattr(mine, name)(x), getattr(ref, name)(x)), name
        if fused:
            qkv = [getattr(mine.self_attn, proj)(x) for proj in ("q_proj", "k_proj", "v_proj")]
            assert same(torch.cat(qkv, dim=-1), ref.self_attn.qkv_proj(x))
        for proj in ("q_proj", "k_proj", "v_proj") if not fused else ():
            assert torch.equal(getattr(mine.self_attn, proj)(x), getattr(ref.self_attn, proj)(x)), proj
        assert mine.self_attn.scaling == pytest.approx(ref.self_attn.scaling)
    assert torch.equal(ours.lm_head(ours.model.norm(x)), theirs.lm_head(theirs.model.norm(x)))


@torch.inference_mode()
def test_rotary_tables_equal_transformers_for_every_layer_type(pair):
    ours, theirs = pair
    positions = torch.tensor([[0, 1, 7, 63, 64, 500, 1023]])
    probe = torch.empty(0)
    rotary = ours.model.rotary_emb
    for kind, layer_type in enumerate(rotary.kinds):
        if getattr(theirs.model.rotary_emb, "layer_types", None):
            expected = theirs.model.rotary_emb(probe, positions, layer_type)
        else:
            expected = theirs.model.rotary_emb(probe, positions)
        cos, sin = rotary(probe, positions, kind)
        assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1]), layer_type


def test_layer_windows_follow_the_config():
    gemma = ModelConfig.from_dict(tiny_reference("gemma3").config.to_dict())
    assert [gemma.window(i) for i in range(4)] == [24, None, 24, 24]
    mistral = ModelConfig.from_dict(tiny_reference("mistral").config.to_dict())
    assert {mistral.window(i) for i in range(4)} == {24}
    assert {ModelConfig.from_dict(tiny_reference("qwen2").config.to_dict()).window(i) for i in range(4)} == {None}
    assert {ModelConfig.from_dict(tiny_reference("phi3").config.to_dict()).window(i) for i in range(4)} == {24}


def test_a_v4_config_reads_as_its_v5_spelling():
    """Checkpoints on disk were written by transformers 4 (rope_theta, rope_scaling, rope_local_base_freq)."""
    llama = tiny_reference("llama").config.to_dict()
    v5 = ModelConfig.from_dict(llama)
    v4 = {k: v for k, v in llama.items() if k != "rope_parameters"}
    v4 |= {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_dict(v4).rope == v5.rope
    gemma = tiny_reference("gemma3").config.to_dict()
    gemma4 = {k: v for k, v in gemma.items() if k not in ("rope_parameters", "layer_types")}
    gemma4 |= {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2}
    read = ModelConfig.from_dict(gemma4)
    assert read.rope[FULL].theta == 1e6 and read.rope[SLIDING].theta == 1e4
    assert read.layer_types == (SLIDING, FULL, SLIDING, FULL)


def test_a_checkpoint_round_trips_through_safetensors_and_refuses_missing_or_pickled_weights(tmp_path):
    reference = tiny_reference("qwen2")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(reference.config.to_dict()))
    config = ModelConfig.read(tmp_path)
    loaded = Transformer.from_state_dict(config, read_safetensors(tmp_path))
    assert loaded.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v bias came with the file
    assert loaded.model.layers[0].self_attn.o_proj.bias is None
    ids = torch.randint(0, config.vocab_size, (1, 5))
    assert torch.equal(loaded.model.embed_tokens(ids), reference.model.embed_tokens(ids))
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelNotFoundError, match="model.layers.1.mlp.up_proj.weight"):
        Transformer.from_state_dict(config, state)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelNotFoundError, match="pickled weights"):
        read_safetensors(tmp_path)


def test_configs_we_cannot_run_are_refused_in_words():
    llama = tiny_reference("llama").config.to_dict()
    with pytest.raises(UnsupportedModelError, match="yarn RoPE is not supported") as refused:
        ModelConfig.from_dict({**llama, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    assert "sequence length" not in str(refused.value)  # YaRN's frequencies are fixed: it is merely not implemented
    with pytest.raises(UnsupportedModelError, match="names no architecture"):
        ModelConfig.from_dict({k: v for k, v in llama.items() if k not in ("architectures", "model_type")})
    with pytest.raises(ModelNotFoundError, match="incomplete"):
        ModelConfig.from_dict({k: v for k, v in llama.items() if k != "hidden_size"})
    with pytest.raises(UnsupportedModelError, match="activation"):
        Transformer.from_state_dict(ModelConfig.from_dict({**llama, "hidden_act": "relu"}), {})


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])  # phi3: fused qkv_proj and gate_up_proj on disk
def test_a_checkpoint_directory_loads_with_its_tokenizer_and_chat_template(tmp_path, arch):
    """`--model DIR`: transformers' save_pretrained output (safetensors, config.json) plus a fast tokenizer and a
    chat template in tokenizer_config.json load through load_model into a runner computing transformers' logits."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvblend.model.loading import load_model
    from kvblend.prompt import PromptTemplate, split_template

    reference = tiny_reference(arch, seed=5)
    reference.save_pretrained(tmp_path)
    words = ["<unk>", "<|im_end|>", *(f"w{i}" for i in range(60))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}assistant:{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": template})
    )
    runner = load_model(str(tmp_path), compute="cpu")
    assert runner.tokenize("w3 w7 nope") == [5, 9, 0]
    assert runner.tokenizer.eos_token_id == 1 and 1 in runner.stop_token_ids
    before, after = split_template(runner, PromptTemplate(system="", before_passages="", after_passages=" {question}"), "w1")
    assert before == "user: " and after == " w1<|im_end|>\nassistant:"
    ids = torch.randint(0, 62, (1, 11))
    with torch.inference_mode():
        positions = torch.arange(11)[None]
        cos, sin = runner.rope(positions)
        hidden = runner.embed(ids)
        for layer in range(runner.n_layers):
            q, k, v = runner.project_qkv(layer, hidden, cos, sin)
            hidden = runner.finish_layer(layer, hidden, runner.attend(layer, q, k, v))
        assert torch.allclose(runner.logits(hidden), reference(ids).logits.float(), atol=1e-5)


def test_a_chat_template_without_a_system_turn_gets_it_in_the_user_turn_and_a_broken_one_is_one_line():
    """Mistral v0.1/v0.2 and Gemma 1 templates raise "Conversation roles must alternate" at a system message,
    which kvblend always sends: every ingest and query ended in a jinja traceback, and no flag avoided it."""
    import pytest
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from kvblend.errors import UnsupportedModelError
    from kvblend.model.tokenizer import TextTokenizer

    alternate = (
        "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
    )
    backend = Tokenizer(WordLevel({"<s>": 0, "<unk>": 1}, unk_token="<unk>"))
    tok = TextTokenizer(backend, {"bos_token": "<s>"}, alternate)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]
    assert tok.apply_chat_template(messages) == "<s>[INST] Be brief.\n\nWho? [/INST]"
    with pytest.raises(UnsupportedModelError, match="refused the prompt: Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "Hi"}])
    broken = TextTokenizer(backend, {}, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(UnsupportedModelError, match="chat template does not parse"):
        broken.apply_chat_template(messages)
