"""Tokenizer and incremental detokenizer, on SmolLM2's real GGUF tokenizer."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.model_source import ModelFormat, ModelSource, resolve_model
from tokenizer_svc.detokenizer import INITIAL_OFFSET, IncrementalDetokenizer
from tokenizer_svc.tokenizer import NoChatTemplateError, Tokenizer, converted_cache_dir

TEXTS = [
    "Hello, my name is",
    "héllo wörld 👋🏽 你好 — `x = 1`\n",
    "日本語のテキスト。한국어 🎉🎉 👨‍👩‍👧‍👦",
    "Ünïcödé: ñ ç ø å ß — “quotes” …",
    "def f(x):\n    return {'k': x ** 2}  # ok\n\n\tindented",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi."},
]
REPO_NAME = 3  # "<repo_name>": flagged special, yet not in transformers' all_special_ids


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # The module converts the GGUF tokenizer once into a private cache, so the
    # user's cache is never touched and test_cache_hit sees a known state.
    path = tmp_path_factory.mktemp("kvfleet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLEET_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def tok(cache_dir: Path, source: ModelSource) -> Tokenizer:
    assert not converted_cache_dir(source.path).exists()
    return Tokenizer.load(source)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int, **kwargs: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert detok.text == "".join(deltas)
    return deltas


def test_smollm2_ids_and_special_tokens(tok: Tokenizer) -> None:
    assert tok.encode("Hello, my name is") == [19556, 28, 957, 1462, 314]  # GGUF: add_bos_token false
    assert tok.eos_token_id == 2 and tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("<repo_name>x<|im_start|>user\nhé 👋🏽<|im_end|>")
    assert REPO_NAME in ids
    assert tok.decode(ids, skip_special_tokens=skip) == tok._hf.decode(ids, skip_special_tokens=skip)


def test_ids_past_the_vocabulary_decode_to_nothing(tok: Tokenizer) -> None:
    assert tok.decode([19556, tok.vocab_size, tok.vocab_size + 7]) == "Hello"


def test_chat_template(tok: Tokenizer) -> None:
    text = tok.render_chat(MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nSay hi.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(MESSAGES) == tok.encode(text, add_special_tokens=False)
    # The template supplies SmolLM2's default system prompt when none is given.
    assert tok.render_chat(MESSAGES[1:], add_generation_prompt=False).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )
    assert not tok.render_chat(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_chat_without_template_is_a_clear_error(tok: Tokenizer, tmp_path: Path) -> None:
    tok._hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer(PreTrainedTokenizerFast.from_pretrained(tmp_path, local_files_only=True), "bare")
    with pytest.raises(NoChatTemplateError, match="'bare' has no chat template"):
        bare.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas = stream(tok, [], ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_back_split_characters(tok: Tokenizer) -> None:
    # Guard the test above: these ids really do split characters across tokens.
    ids = tok.encode("👋🏽 你好")
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(tok, [], ids, 1)
    assert "" in deltas and "".join(deltas) == "👋🏽 你好"


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_after_chat_prompt(tok: Tokenizer, skip: bool, spaces: bool, chunk: int) -> None:
    prompt = tok.apply_chat_template(MESSAGES)
    ids = tok.encode("Hi 👋🏽! <repo_name>x — 你好", add_special_tokens=False) + [tok.eos_token_id]
    deltas = stream(tok, prompt, ids, chunk, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    expected = tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert "".join(deltas) == expected
    assert expected == ("Hi 👋🏽! x — 你好" if skip else "Hi 👋🏽! <repo_name>x — 你好<|im_end|>")
    assert not any("\ufffd" in d for d in deltas)


def test_step_decodes_a_window_not_the_history(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    window_sizes: list[int] = []
    to_string = tok.convert_tokens_to_string

    def spy(tokens: list[str], spaces_between_special_tokens: bool = True) -> str:
        window_sizes.append(len(tokens))
        return to_string(tokens, spaces_between_special_tokens)

    monkeypatch.setattr(tok, "convert_tokens_to_string", spy)
    ids = tok.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 1000
    stream(tok, tok.apply_chat_template(MESSAGES), ids, 1)
    # Context plus the tokens of the longest held-back character.
    assert max(window_sizes) <= INITIAL_OFFSET + 4


def test_spaces_between_special_tokens_with_a_spacing_decoder() -> None:
    # SmolLM2's byte-level decoder never adds spaces; WordPiece puts one before
    # every token, which is what the flag suppresses around added tokens.
    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s"])}
    raw = RawTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")
    wordpiece = Tokenizer(hf, "wordpiece")
    ids = [1, 3, 4, 5, 2, 2, 3]
    expected = {True: "[CLS] hello worlds [SEP] [SEP] hello", False: "[CLS]hello worlds[SEP][SEP]hello"}
    for spaces, text in expected.items():
        assert wordpiece.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces) == text
        for chunk in (1, 3):
            deltas = stream(wordpiece, [], ids, chunk, skip_special_tokens=False, spaces_between_special_tokens=spaces)
            assert "".join(deltas) == text
    assert wordpiece.decode(ids) == "hello worlds hello"


def test_hf_directory_gives_identical_ids(tok: Tokenizer, tmp_path: Path) -> None:
    tok._hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    source = resolve_model(str(tmp_path))
    assert source == ModelSource(ModelFormat.HF_DIR, tmp_path)
    from_dir = Tokenizer.load(source)
    for text in TEXTS:
        assert from_dir.encode(text) == tok.encode(text)
    assert from_dir.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    assert (from_dir.eos_token_id, from_dir.bos_token_id, from_dir.vocab_size) == (2, 1, 49152)


def test_second_load_hits_the_cache(
    tok: Tokenizer, source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = converted_cache_dir(source.path)
    assert cached.is_dir()
    loads: list[tuple] = []
    original = PreTrainedTokenizerFast.from_pretrained

    def spy(*args, **kwargs):
        loads.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", spy)
    again = Tokenizer.load(source)
    assert [args for args, kwargs in loads] == [(cached,)] and "gguf_file" not in loads[0][1]
    # The saved files must reproduce the conversion exactly, special tokens included.
    assert (again.vocab_size, again.eos_token_id, again.bos_token_id) == (tok.vocab_size, 2, 1)
    assert again._special_ids == tok._special_ids
    probe = "".join(TEXTS) + "<|im_start|><repo_name><|endoftext|>"
    assert again.encode(probe) == tok.encode(probe)
    assert again.render_chat(MESSAGES) == tok.render_chat(MESSAGES)
    assert again.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


def test_the_engine_flags_choose_the_tokenizer_and_its_chat_template(tmp_path: Path) -> None:
    """--tokenizer names where the tokenizer comes from; --chat-template replaces the model's."""
    from services.config import EngineConfig

    Tokenizer.load(resolve_model("smollm2")).save_pretrained(tmp_path)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tokenizer = Tokenizer.for_engine(EngineConfig(model="smollm2", tokenizer=str(tmp_path)), template)
    assert tokenizer.name == tmp_path.name
    assert tokenizer.render_chat([{"role": "user", "content": "Hi"}]) == "<user>Hi"
    assert "<|im_start|>" in Tokenizer.for_engine(EngineConfig()).render_chat([{"role": "user", "content": "Hi"}])
