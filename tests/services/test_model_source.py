"""resolve_model: aliases, files, directories, and Hugging Face repo ids found in the
local HF cache (never downloaded), in the cache's real layout: refs/<revision> names a
commit, snapshots/<commit>/ holds symlinks into blobs/."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from services.model_source import ModelFormat, ModelNotFoundError, ModelSource, hf_hub_cache, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
HF_FILES = {"config.json": b'{"model_type": "qwen2"}', "tokenizer.json": b"{}", "model.safetensors": b"weights"}


def cache_repo(hub: Path, repo_id: str, files: dict[str, bytes | Path], commit: str = COMMIT,
               ref: str | None = "main") -> Path:
    """Writes a repo into the HF cache `hub` as huggingface_hub does; returns its snapshot."""
    repo_dir = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(Path("../..") / "blobs" / blob.name, snapshot / name)  # relative, as the hub writes them
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)  # no newline, as the hub writes it
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache under HF_HOME, whatever the machine's own settings."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return tmp_path / "hf-home" / "hub"


# --- where the cache is -------------------------------------------------------------------


def test_cache_location_follows_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hf_hub_cache() == tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hf_hub_cache() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert hf_hub_cache() == tmp_path / "hub-cache"


def test_hf_hub_cache_wins_over_hf_home(hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = cache_repo(tmp_path / "elsewhere", "org/tiny", HF_FILES)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert resolve_model("org/tiny").path == snapshot


# --- repo ids -----------------------------------------------------------------------------


def test_repo_id_resolves_to_the_snapshot_refs_main_names(hub: Path) -> None:
    snapshot = cache_repo(hub, "org/tiny", HF_FILES)
    cache_repo(hub, "org/tiny", HF_FILES, commit=OTHER_COMMIT, ref=None)  # an older snapshot beside it
    source = resolve_model("org/tiny")
    assert source == ModelSource(ModelFormat.HF_DIR, snapshot, repo_id="org/tiny")
    assert source.name == "org/tiny"  # not the commit hash the directory is named after
    assert (source.path / "config.json").is_symlink()
    assert json.loads((source.path / "config.json").read_text()) == {"model_type": "qwen2"}


def test_revision_is_a_ref_or_a_commit(hub: Path) -> None:
    cache_repo(hub, "org/tiny", HF_FILES)
    tagged = cache_repo(hub, "org/tiny", HF_FILES, commit=OTHER_COMMIT, ref="v1.0")
    assert resolve_model("org/tiny", revision="v1.0").path == tagged
    assert resolve_model("org/tiny", revision=OTHER_COMMIT).path == tagged
    with pytest.raises(ModelNotFoundError, match=f"no snapshot for revision 'v2'.*{COMMIT}, {OTHER_COMMIT}"):
        resolve_model("org/tiny", revision="v2")


def test_a_lone_snapshot_serves_without_refs(hub: Path) -> None:
    """A cache copied by hand may lose refs/: one snapshot is unambiguous, two are not."""
    snapshot = cache_repo(hub, "org/tiny", HF_FILES, ref=None)
    assert resolve_model("org/tiny").path == snapshot
    cache_repo(hub, "org/tiny", HF_FILES, commit=OTHER_COMMIT, ref=None)
    with pytest.raises(ModelNotFoundError, match="no snapshot for revision 'main'"):
        resolve_model("org/tiny")


def test_uncached_repo_id_says_how_to_fetch_it(hub: Path) -> None:
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("org/absent")
    message = str(error.value)
    assert "not in the local Hugging Face cache" in message
    assert str(hub / "models--org--absent") in message
    assert "huggingface-cli download org/absent" in message
    assert "never downloads" in message


def test_a_local_directory_wins_over_a_repo_id(hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_repo(hub, "org/tiny", HF_FILES)
    local = tmp_path / "work" / "org" / "tiny"
    local.mkdir(parents=True)
    for name, content in HF_FILES.items():
        (local / name).write_bytes(content)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("org/tiny") == ModelSource(ModelFormat.HF_DIR, Path("org/tiny"))


def test_gguf_only_snapshot(hub: Path) -> None:
    snapshot = cache_repo(hub, "org/one-gguf", {"tiny.Q4_0.gguf": b"GGUF", "README.md": b"hi"})
    source = resolve_model("org/one-gguf")
    assert (source.format, source.path, source.name) == (ModelFormat.GGUF, snapshot / "tiny.Q4_0.gguf", "org/one-gguf")
    snapshot = cache_repo(hub, "org/many-ggufs", {"tiny.Q4_0.gguf": b"GGUF 4", "tiny.Q8_0.gguf": b"GGUF 8"})
    with pytest.raises(ModelNotFoundError, match="several .gguf files") as error:
        resolve_model("org/many-ggufs")
    assert str(snapshot / "tiny.Q4_0.gguf") in str(error.value)
    assert str(snapshot / "tiny.Q8_0.gguf") in str(error.value)


def test_snapshot_whose_blobs_are_missing(hub: Path) -> None:
    snapshot = cache_repo(hub, "org/tiny", HF_FILES)
    shutil.rmtree(snapshot.parents[1] / "blobs")  # the links dangle, as in a cache copied without blobs/
    with pytest.raises(ModelNotFoundError, match="neither config.json nor a .gguf file"):
        resolve_model("org/tiny")


# --- tokenizer files, checked before anything loads -------------------------------------------


@pytest.mark.parametrize(
    "tokenizer_files",
    [["tokenizer.json"], ["tokenizer.model"], ["vocab.json", "merges.txt"], ["tokenizer.json", "tokenizer_config.json"]],
)
def test_directory_with_a_tokenizer(tmp_path: Path, tokenizer_files: list[str]) -> None:
    for name in ["config.json", "model.safetensors", *tokenizer_files]:
        (tmp_path / name).write_text("{}")
    assert resolve_model(str(tmp_path)) == ModelSource(ModelFormat.HF_DIR, tmp_path)


@pytest.mark.parametrize("tokenizer_files", [[], ["tokenizer_config.json"], ["vocab.json"]])
def test_directory_without_a_tokenizer_names_the_missing_files(tmp_path: Path, tokenizer_files: list[str]) -> None:
    for name in ["config.json", "model.safetensors", *tokenizer_files]:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ModelNotFoundError, match="has config.json but no tokenizer") as error:
        resolve_model(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt"):
        assert name in str(error.value)
    # With the tokenizer from elsewhere (--tokenizer), weights alone are a model.
    assert resolve_model(str(tmp_path), require_tokenizer=False) == ModelSource(ModelFormat.HF_DIR, tmp_path)


def test_cached_repo_without_a_tokenizer(hub: Path) -> None:
    cache_repo(hub, "org/weights-only", {"config.json": b"{}", "model.safetensors": b"weights"})
    with pytest.raises(ModelNotFoundError, match="'org/weights-only'.*no tokenizer"):
        resolve_model("org/weights-only")


# --- end to end: the SDK serves a cached repo -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen2 in HF format with SmolLM2's tokenizer, and transformers' copy of it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tokenizer_svc.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("smollm2"))
    config = Qwen2Config(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return path, model


def test_llm_serves_a_cached_repo_id(hub: Path, tiny_model_dir, make_llm) -> None:
    from kvfleet import SamplingParams

    from conftest import hf_greedy

    path, hf_model = tiny_model_dir
    cache_repo(hub, "org/tiny-qwen2", {p.name: p for p in path.iterdir() if p.is_file()})
    llm = make_llm("org/tiny-qwen2", dtype="float32", block_size=16)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)
    assert output.outputs[0].text == llm.get_tokenizer().decode(output.outputs[0].token_ids)


def test_llm_with_an_uncached_repo_id_fails_clearly(hub: Path) -> None:
    from kvfleet import LLM

    with pytest.raises(ModelNotFoundError, match="huggingface-cli download org/absent"):
        LLM("org/absent")
