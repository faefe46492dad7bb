"""Refreshes kvfleet/vllm_reference.json: the names of vLLM's `vllm serve` flags and of
its completions and chat request fields, read from a vLLM source tree with `ast` (vLLM
is never imported, so neither it nor torch needs installing).

    python tools/vllm_reference.py PATH/TO/vllm-source > kvfleet/vllm_reference.json
    python -m kvfleet.vllm_differences   # then regenerate docs/vllm_differences.md

PATH is the directory holding the `vllm` package: a checkout, or an unpacked wheel (a
wheel is a zip; its .py files are the release's source). Only names are taken, never
help texts or code. Where vLLM builds its parser changes between releases, this script
fails loudly rather than write a short list.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ARG_UTILS = "vllm/engine/arg_utils.py"
CLI_ARGS = "vllm/entrypoints/openai/cli_args.py"
SERVE = "vllm/entrypoints/cli/serve.py"
PROTOCOLS = {
    "completions": ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest"),
    "chat": ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
}
# The frontend dataclasses whose fields become `--field-name` flags, in vLLM's order.
FRONTEND_CLASSES = ("BaseFrontendArgs", "FrontendArgs")


def _tree(root: Path, path: str) -> ast.Module:
    return ast.parse((root / path).read_text(encoding="utf-8"), path)


def _strings(nodes: list[ast.expr]) -> list[str]:
    return [node.value for node in nodes if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _function(tree: ast.AST, name: str) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name]


def _add_argument_calls(function: ast.FunctionDef, default_group: str) -> list[tuple[list[str], str]]:
    """Each `x.add_argument("--a", "-b", ...)` in `function`, with the title of the
    argument group `x` is (`x = parser.add_argument_group(title=...)`)."""
    groups: dict[str, str] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument_group":
                title = next((k.value for k in call.keywords if k.arg == "title"), None)
                title = title.value if isinstance(title, ast.Constant) else (_strings(call.args) or [None])[0]
                for target in node.targets:
                    if isinstance(target, ast.Name) and title:
                        groups[target.id] = title
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            options = [s for s in _strings(node.args) if s.startswith("-")]
            if options:
                owner = node.func.value
                found.append((options, groups.get(owner.id, default_group) if isinstance(owner, ast.Name)
                              else default_group))
    # ast.walk is breadth first: put them back in source order, as --help lists them.
    return sorted(found, key=lambda item: _line_of(function, item[0][0]))


def _line_of(function: ast.FunctionDef, option: str) -> int:
    for node in ast.walk(function):
        if isinstance(node, ast.Constant) and node.value == option:
            return node.lineno
    raise AssertionError(option)


def _dataclass_fields(tree: ast.Module, class_name: str) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [item.target.id for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and not item.target.id.startswith("_") and not _is_classvar(item.annotation)]
    raise SystemExit(f"no class {class_name}: vLLM's layout changed; update {__file__}")


def _is_classvar(annotation: ast.expr) -> bool:
    return "ClassVar" in ast.unparse(annotation)


def _request_fields(root: Path, path: str, class_name: str) -> list[str]:
    """The wire names of a pydantic request model's own fields (an alias where it has one)."""
    tree = _tree(root, path)
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                name = item.target.id
                if name.startswith("_") or _is_classvar(item.annotation):
                    continue
                alias = None
                if isinstance(item.value, ast.Call) and ast.unparse(item.value.func) == "Field":
                    alias = next((k.value.value for k in item.value.keywords
                                  if k.arg == "alias" and isinstance(k.value, ast.Constant)), None)
                names.append(alias or name)
            return names
    raise SystemExit(f"no class {class_name} in {path}: vLLM's layout changed; update {__file__}")


def serve_flags(root: Path) -> list[dict]:
    """`vllm serve`'s options in --help's order: make_arg_parser's own, the frontend
    dataclasses' fields, the engine's, and the serve command's."""
    cli_args = _tree(root, CLI_ARGS)
    [make_parser] = _function(cli_args, "make_arg_parser")
    calls = _add_argument_calls(make_parser, "serve")
    for class_name in FRONTEND_CLASSES:
        calls += [([f"--{name.replace('_', '-')}"], "Frontend") for name in _dataclass_fields(cli_args, class_name)]
    arg_utils = _tree(root, ARG_UTILS)
    for function in _function(arg_utils, "add_cli_args"):
        calls += _add_argument_calls(function, "AsyncEngineArgs")
    for function in _function(_tree(root, SERVE), "subparser_init"):
        calls += _add_argument_calls(function, "serve")
    flags, seen = [], set()
    for options, group in calls:
        long = next((o for o in options if o.startswith("--")), options[0])
        if long in seen:
            continue
        seen.add(long)
        flags.append({"flag": long, "aliases": [o for o in options if o != long], "group": group})
    if len(flags) < 100:
        raise SystemExit(f"only {len(flags)} flags found: vLLM's layout changed; update {__file__}")
    return flags


def version(root: Path) -> str:
    for node in ast.walk(_tree(root, "vllm/_version.py")):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return node.value.value
    raise SystemExit("no __version__ in vllm/_version.py")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    reference = {
        "vllm": version(root),
        "taken_from": [ARG_UTILS, CLI_ARGS, SERVE, *(path for path, _ in PROTOCOLS.values())],
        "serve_flags": serve_flags(root),
        "request_fields": {endpoint: _request_fields(root, path, cls) for endpoint, (path, cls) in PROTOCOLS.items()},
    }
    json.dump(reference, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
