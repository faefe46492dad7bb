"""Writes docs/vllm_differences.md: every `vllm serve` flag and every completions and chat
request field of vLLM that kvfleet rejects or ignores, one line each with why and what
to use instead.

Which ones is read from kvfleet's code, so the page stays true as the code changes: the
options of the `kvfleet serve` parser (kvfleet/cli.py) and the fields of the gateway's
request models (gateway/protocol.py), against vLLM's names (kvfleet/vllm_reference.json,
refreshed from a vLLM release by tools/vllm_reference.py). A flag or field kvfleet takes
but does nothing with says so where it is defined: its help (a flag) or description (a
field) starts with "accepted for vLLM's sake: <why>". The reasons for the rest are the
CLI's own for flags it refuses by name (services/cli_args.py), else kvfleet/vllm_reasons.py.

    python -m kvfleet.vllm_differences          # rewrites docs/vllm_differences.md
    python -m kvfleet.vllm_differences --check  # exit 1 if the page is out of date
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.cli import build_parser
from kvfleet.vllm_reasons import FALLBACK, FIELD_REASONS, FLAG_REASONS, GROUP_REASONS
from services.cli_args import VLLM_FLAGS_NOT_SUPPORTED

REFERENCE = Path(__file__).with_name("vllm_reference.json")
DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm_differences.md"
# How a flag's help or a field's description marks what kvfleet takes and ignores.
IGNORED = "accepted for vLLM's sake: "
DEFAULT_IN_HELP = " (default: %(default)s)"  # argparse's, which some helps end with
REQUEST_MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
# What kvfleet does with one.
TAKEN, REFUSED, UNRECOGNIZED, DROPPED = "accepted, no effect", "refused by name", "unrecognized", "dropped"


@dataclass(frozen=True)
class Difference:
    name: str  # a flag, or a request field
    where: str  # the flag's vLLM argument group, or the endpoints that have the field
    how: str  # what kvfleet does with it
    why: str  # and why, and what to use instead

    def line(self, where: bool = True) -> str:
        return f"- `{self.name}`{f' ({self.where})' if where else ''}: {self.how}; {self.why}"


def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


def serve_options() -> dict[str, argparse.Action]:
    """Each option string of `kvfleet serve`, with its action."""
    serve = build_parser().parse_known_args(["serve"])[0].command_parser
    return {option: action for action in serve._actions for option in action.option_strings}


def _ignored_why(text: str | None) -> str | None:
    if not text or not text.startswith(IGNORED):
        return None
    return text[len(IGNORED):].removesuffix(DEFAULT_IN_HELP)


def flag_differences(flags: list[dict[str, Any]], options: dict[str, argparse.Action]) -> list[Difference]:
    """vLLM's serve flags that `kvfleet serve` refuses or ignores, in vLLM's order."""
    found = []
    for entry in flags:
        flag, group = entry["flag"], entry["group"]
        if flag in options:
            if (why := _ignored_why(options[flag].help)) is not None:
                found.append(Difference(flag, group, TAKEN, why))
            found += [Difference(alias, group, UNRECOGNIZED, f"kvfleet spells it `{flag}`")
                      for alias in entry["aliases"] if alias not in options]
        elif flag in VLLM_FLAGS_NOT_SUPPORTED:
            found.append(Difference(flag, group, REFUSED, VLLM_FLAGS_NOT_SUPPORTED[flag]))
        else:
            why = FLAG_REASONS.get(flag) or GROUP_REASONS.get(group) or FALLBACK
            found.append(Difference(flag, group, UNRECOGNIZED, why))
    return found


def field_differences(fields: dict[str, list[str]]) -> list[Difference]:
    """vLLM's completions and chat request fields the gateway drops or ignores, each once
    with the endpoints it concerns (completions' order, then chat's)."""
    endpoints: dict[tuple[str, str, str], list[str]] = {}  # (field, how, why): its endpoints
    for endpoint, names in fields.items():
        known = {info.alias or name: info for name, info in REQUEST_MODELS[endpoint].model_fields.items()}
        for name in names:
            if name not in known:
                how, why = DROPPED, FIELD_REASONS.get(name, FALLBACK)
            elif (why := _ignored_why(known[name].description)) is not None:
                how = TAKEN
            else:
                continue
            endpoints.setdefault((name, how, why), []).append(endpoint)
    return [Difference(name, ", ".join(where), how, why) for (name, how, why), where in endpoints.items()]


def stale_reasons(ref: dict[str, Any], options: dict[str, argparse.Action]) -> list[str]:
    """Entries of kvfleet/vllm_reasons.py that no longer explain anything: the flag or
    field is kvfleet's now (or no longer vLLM's), or the CLI gives its own reason."""
    lacking = {d.name for d in flag_differences(ref["serve_flags"], options) if d.how == UNRECOGNIZED}
    stale = [flag for flag in FLAG_REASONS if flag not in lacking]
    groups = {entry["group"] for entry in ref["serve_flags"]
              if entry["flag"] in lacking and entry["flag"] not in FLAG_REASONS}
    stale += [group for group in GROUP_REASONS if group not in groups]
    dropped = {d.name for d in field_differences(ref["request_fields"]) if d.how == DROPPED}
    return stale + [name for name in FIELD_REASONS if name not in dropped]


def _grouped(differences: list[Difference]) -> Iterator[str]:
    """Under a heading per group, the groups in the order they first come."""
    groups: dict[str, list[Difference]] = {}
    for difference in differences:
        groups.setdefault(difference.where, []).append(difference)
    for group, members in groups.items():
        yield f"\n### {group}\n"
        yield from (difference.line(where=False) for difference in members)


def render(ref: dict[str, Any] | None = None, options: dict[str, argparse.Action] | None = None) -> str:
    ref = ref if ref is not None else reference()
    options = options if options is not None else serve_options()
    flags = flag_differences(ref["serve_flags"], options)
    rejected = [d for d in flags if d.how != TAKEN]
    ignored_flags = [d for d in flags if d.how == TAKEN]
    fields = field_differences(ref["request_fields"])
    dropped = [d for d in fields if d.how == DROPPED]
    ignored_fields = [d for d in fields if d.how == TAKEN]
    num_flags = len(ref["serve_flags"])
    num_taken = sum(entry["flag"] in options for entry in ref["serve_flags"])
    lines = [
        "# vLLM flags and request fields kvfleet rejects or ignores",
        "",
        "<!-- Generated by `python -m kvfleet.vllm_differences`: do not edit by hand. -->",
        "",
        f"What a launch line or a request written for vLLM {ref['vllm']} may carry that kvfleet does not act on, "
        "each with why and what to use instead. The page is generated from kvfleet's code (the `kvfleet serve` "
        "parser, the gateway's request models) and vLLM's names (`kvfleet/vllm_reference.json`, read from vLLM's "
        "source by `tools/vllm_reference.py`); `tests/kvfleet/test_vllm_differences.py` fails when it is out of "
        "date. The values kvfleet refuses of a flag it has (`--quantization awq`, `--kv-cache-dtype fp8`, ...) are "
        "in [configuration.md](configuration.md).",
        "",
        f"`kvfleet serve` takes {num_taken} of vLLM's {num_flags} `vllm serve` flags, {len(ignored_flags)} of them "
        f"without effect; of the completions and chat request fields, it drops {len(dropped)} and takes "
        f"{len(ignored_fields)} without effect.",
        "",
        "## `vllm serve` flags kvfleet rejects",
        "",
        "`kvfleet serve` ends at once with exit code 2 and one line naming the flag: its reason when it is refused by "
        "name, `unrecognized arguments` otherwise. In vLLM's argument groups:",
        *_grouped(rejected),
        "",
        "## `vllm serve` flags kvfleet accepts without effect",
        "",
        *(d.line() for d in ignored_flags),
        "",
        "## Request fields kvfleet ignores",
        "",
        "The gateway drops a field it does not know and serves the request without it, logging the names once per "
        "request (`The following fields were present in the request but ignored: {...}`), as vLLM's server does.",
        "",
        *(d.line() for d in dropped),
        *(["", "Taken, and without effect:", "", *(d.line() for d in ignored_fields)] if ignored_fields else []),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet.vllm_differences", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/vllm_differences.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is out of date: run `python -m kvfleet.vllm_differences`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
