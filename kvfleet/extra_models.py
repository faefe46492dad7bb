"""`cluster up --extra-model "MODEL [ENGINE FLAGS]"`: another model behind the same gateway.

The value reads as the rest of a `vllm serve` (or `kvfleet serve`) command line: the
model, then the engine flags of that model alone (none of the main model's flags apply
to it), e.g. `--extra-model "all-minilm-l6-v2 --data-parallel-size 2"` or
`--extra-model "smollm2 --convert embed"`. Each extra model gets a tokenizer and, per
replica (vLLM's --data-parallel-size, as `cluster up` takes it for the main model too), a
worker and a scheduler of its own; the gateway serves it under its MODEL name
(docs/cluster.md).
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from services.cli_args import add_engine_args, at_least, engine_args, engine_argv
from services.config import ConfigError, EngineConfig


@dataclass(frozen=True)
class ExtraModel:
    name: str  # its --model: its name for clients and in its leases
    flags: argparse.Namespace  # its engine flags

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(**engine_args(self.flags))

    def argv(self, only: tuple[str, ...] | None = None) -> list[str]:
        return engine_argv(self.flags, only)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"--extra-model {self.prog!r}: {message}")


def add_data_parallel_arg(parser: argparse.ArgumentParser) -> None:
    """vLLM's --data-parallel-size, as `cluster up` runs it: that many replicas of the model."""
    parser.add_argument("--data-parallel-size", "-dp", type=at_least(1), default=1, metavar="N",
                        help="replicas of the model, each a worker and its scheduler, which the gateways route "
                        "among (default: %(default)s)")


def parse_extra_model(text: str) -> ExtraModel:
    """One --extra-model value; ConfigError naming what is wrong in it."""
    parser = _Parser(prog=text, add_help=False)
    parser.add_argument("model_tag", metavar="MODEL")
    add_engine_args(parser)
    add_data_parallel_arg(parser)
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"--extra-model {text!r}: {exc}") from None
    if not words or words[0].startswith("-"):
        raise ConfigError(f"--extra-model {text!r}: give the model first, then its engine flags")
    flags = parser.parse_args(words)
    flags.model = flags.model_tag
    return ExtraModel(flags.model, flags)


def extra_model_arg(text: str) -> ExtraModel:
    """An argparse type: the CLI shows the reason in its one line."""
    try:
        return parse_extra_model(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
