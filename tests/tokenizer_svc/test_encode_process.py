"""Huge texts are encoded in a child process (the Rust tokenizer frees a huge Encoding
with the GIL held): the ids equal transformers', a killed child is replaced, and the
child never outlives its parent."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from services.model_source import resolve_model
from tokenizer_svc.encode_process import HUGE_TEXT_CHARS, EncodeProcess
from tokenizer_svc.tokenizer import Tokenizer

PIECES = ["Hello, my name is", "héllo wörld 👋🏽 你好 — `x = 1`\n", "<|im_start|>user\nhé<|im_end|>", "\t  indented",
          "日本語のテキスト。", "def f(x):\n    return x ** 2\n"]


def huge_text(seed: int) -> str:
    rng = random.Random(seed)
    pieces: list[str] = []
    while sum(map(len, pieces)) <= HUGE_TEXT_CHARS:
        pieces.append(rng.choice(PIECES))
    return "".join(pieces)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def files(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def test_a_huge_text_has_transformers_ids(tokenizer: Tokenizer, files: Path) -> None:
    oracle = PreTrainedTokenizerFast.from_pretrained(files)
    text = huge_text(0)
    children_before = set(psutil.Process().children())
    for add_special_tokens in (True, False):
        assert tokenizer.encode(text, add_special_tokens) == oracle.encode(text, add_special_tokens=add_special_tokens)
    [child] = set(psutil.Process().children()) - children_before
    assert "tokenizer_svc.encode_process" in child.cmdline()


def test_a_killed_child_is_replaced_and_bad_text_spares_it(files: Path) -> None:
    rust = RustTokenizer.from_file(str(files / "tokenizer.json"))
    others = set(psutil.Process().children())
    process = EncodeProcess(rust)
    try:
        text = huge_text(1)
        expected = rust.encode(text).ids
        assert process.encode(text, True) == expected
        [first] = set(psutil.Process().children()) - others
        os.kill(first.pid, signal.SIGKILL)
        first.wait(5)
        assert process.encode(text, True) == expected
        [second] = set(psutil.Process().children()) - others
        assert second.pid != first.pid
        with pytest.raises(UnicodeEncodeError):
            process.encode("a lone surrogate \ud800", True)
        assert process.encode(PIECES[1], False) == rust.encode(PIECES[1], add_special_tokens=False).ids
        assert set(psutil.Process().children()) - others == {second}
    finally:
        process.close()
    assert set(psutil.Process().children()) == others


def test_the_child_ends_with_its_parent(files: Path) -> None:
    script = (
        "import os, sys, psutil; from tokenizers import Tokenizer\n"
        "from tokenizer_svc.encode_process import EncodeProcess\n"
        "process = EncodeProcess(Tokenizer.from_file(sys.argv[1]))\n"
        "process.encode('hello', True); print(psutil.Process().children()[0].pid, flush=True)\n"
        "os._exit(0)  # no clean-up: as if killed\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(files / "tokenizer.json")], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parents[2])
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the encode child outlived its parent"
        time.sleep(0.05)
