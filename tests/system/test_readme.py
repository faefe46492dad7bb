"""The examples of README.md and of the reference pages under docs/, run as written
against real processes, ports aside.

Every fenced code block of those pages is marked by an HTML comment on the line before
its fence (GitHub renders nothing of it), and the first test fails on a block marked
neither way:

    <!-- runnable: id=NAME [starts=KIND] [needs=KIND[,KIND]] -->
    <!-- not run: why (e.g. it installs things, or needs docker) -->

- A block without `starts` is a script: Python runs with this interpreter, shell with
  bash (`-e`) with this virtualenv's bin/ first on PATH; it must exit 0, and what it
  prints is checked where `CHECKS` knows the block.
- `starts=KIND` is a server: each of its commands runs as a long-running process until
  the gateway's /health answers 200, and SIGTERM must end each with exit code 0. The
  blocks that say `needs=KIND` run while it serves (one server per kind, shared), on
  whichever page each stands: ids and server kinds are unique across all the pages.
- `needs=nats,redis`: nats-server and a Redis-compatible server are started first.

The pages' ports (8000, the roles' 50051-50053, NATS's 4222, Redis's 6379) are replaced
by the real ones: free ports for what a block starts; for `kvfleet cluster up`, whose roles
listen on ports of its choosing, the addresses it logs (`scheduler: gRPC on HOST:PORT`).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest

from kvfleet.processes import free_port, spawn, start_listening, start_nats, start_redis, stop

REPO = Path(__file__).resolve().parents[2]
# The front door and every reference page: examples move between them freely.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LOCAL = "127.0.0.1"
HTTP_PORT = 8000  # the pages' gateway / `kvfleet serve` port
# The pages' ports of the roles started by hand, which `cluster up` picks itself.
ROLE_PORTS = {"worker": 50051, "scheduler": 50052, "tokenizer": 50053}
INFRA_PORTS = {"nats": 4222, "redis": 6379}
START_TIMEOUT_S = 300.0  # two shared cores, several model loads
RUN_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0

MARK = re.compile(r"^<!--\s*(runnable|not run)\s*:(.*?)-->\s*$")
FENCE = re.compile(r"^```(.*)$")
# Where a page writes a port: a loopback address (in a URL or not), or a --port flag.
PORT = re.compile(r"(127\.0\.0\.1:|localhost:|--port\s+)(\d{2,5})\b")
SERVER_KINDS = ("serve", "cluster", "roles")


@dataclass
class Block:
    page: str  # the page's path, relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    mark: str | None  # "runnable", "not run", or None when unmarked
    note: str  # the marker's text after the colon
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.attrs.get("id", f"line-{self.line}")

    @property
    def needs(self) -> list[str]:
        return [need for need in self.attrs.get("needs", "").split(",") if need]

    def __repr__(self) -> str:
        return f"{self.page}:{self.line} ({self.id})"


def code_blocks(text: str, page: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"), None)
        assert end is not None, f"{page}:{index + 1}: a code block that never closes"
        mark = MARK.match(lines[index - 1]) if index > 0 else None
        note = mark.group(2).strip() if mark else ""
        runnable = mark is not None and mark.group(1) == "runnable"
        attrs = dict(pair.split("=", 1) for pair in note.split() if "=" in pair) if runnable else {}
        blocks.append(Block(page, index + 1, opening.group(1).strip(), "\n".join(lines[index + 1:end]) + "\n",
                            mark.group(1) if mark else None, note, attrs))
        index = end + 1
    return blocks


BLOCKS = [block for path in PAGES for block in code_blocks(path.read_text(), str(path.relative_to(REPO)))]
RUNNABLE = [block for block in BLOCKS if block.mark == "runnable"]
# Those that need no server first, whatever their page: a server, once up, serves the rest
# of the module, and would share the machine with them.
SCRIPTS = sorted((block for block in RUNNABLE if "starts" not in block.attrs), key=lambda block: bool(block.needs))
SERVERS = [block for block in RUNNABLE if "starts" in block.attrs]


def server_block(kind: str) -> Block:
    [block] = [block for block in SERVERS if block.attrs["starts"] == kind]
    return block


def substitute(code: str, ports: dict[int, int], where: str) -> str:
    """`code` with every port a page names replaced by the real one; each must be known."""
    def replace(match: re.Match[str]) -> str:
        port = int(match.group(2))
        assert port in ports, f"{where} names port {port}, which nothing started here listens on ({ports})"
        return f"{match.group(1)}{ports[port]}"

    return PORT.sub(replace, code)


def shell_commands(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, blank lines and comments dropped."""
    commands = [line.strip() for line in code.replace("\\\n", " ").splitlines()]
    return [command for command in commands if command and not command.startswith("#")]


def block_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(KVFLEET_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    # As docs/cluster.md says to export it: the roles it starts and the programs that call them share it.
    env["KVFLEET_CLUSTER_TOKEN"] = "readme-cluster-token"
    return env


# -- servers -----------------------------------------------------------------------------


@dataclass
class Running:
    """A server block's processes, in start order, and the real port of each port its page names."""

    block: Block
    processes: list[subprocess.Popen]
    ports: dict[int, int]
    log_path: Path
    infra: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{LOCAL}:{self.ports[HTTP_PORT]}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 8000) -> str:
        """What conftest's report hook shows under a failed test."""
        codes = [process.poll() for process in self.processes]
        return f"[{self.block!r}, exit codes {codes}] ...\n{self.log()[-chars:]}"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(self.url):
            exited = [process.args for process in self.processes if process.poll() is not None]
            assert not exited, f"exited while starting: {exited}\n{self.log_tail()}"
            assert time.monotonic() < deadline, f"not healthy in {START_TIMEOUT_S} s\n{self.log_tail()}"
            time.sleep(0.5)

    def stop(self) -> list[int | None]:
        """SIGTERM to each process, the last started (the gateway) first; their exit codes."""
        codes = []
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                codes.append(process.wait(timeout=STOP_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        for process in self.infra:
            stop(process)
        return codes


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def start_server(block: Block, log_dir: Path) -> Running:
    """Runs a `starts=` block: each command of it as its own process (as in a terminal of
    its own), with fresh ports, after the infrastructure it needs; healthy on return."""
    log_path = log_dir / "server.log"
    env = block_env()
    infra: list[subprocess.Popen] = []
    ports: dict[int, int] = {}
    try:
        with open(log_path, "ab") as log:  # O_APPEND: every child writes here
            for need in block.needs:
                assert need in INFRA_PORTS, f"{block!r}: unknown need {need!r}"
                started = start_listening(partial(start_nats if need == "nats" else start_redis, LOCAL), LOCAL,
                                          log_path)
                infra.append(started.process)
                ports[INFRA_PORTS[need]] = started.port
            for _, port in PORT.findall(block.code):
                if int(port) not in ports:
                    ports[int(port)] = free_port()
            assert HTTP_PORT in ports, f"{block!r} starts nothing on port {HTTP_PORT}"
            # As its own process group (no terminal's Ctrl-C), dying with this test process.
            processes = [spawn(["bash", "-c", f"exec {command}"], env=env, cwd=log_dir, stdout=log,
                               stderr=subprocess.STDOUT)
                         for command in shell_commands(substitute(block.code, ports, repr(block)))]
    except BaseException:
        for process in infra:
            stop(process)
        raise
    running = Running(block, processes, ports, log_path, infra)
    try:
        running.wait_healthy()
    except BaseException:
        running.stop()
        raise
    return running


@contextmanager
def serving(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = start_server(server_block(kind), tmp_path_factory.mktemp(f"readme-{kind}"))
    try:
        yield running
    finally:
        codes = running.stop()
        assert codes == [0] * len(codes), f"exit codes on SIGTERM (last started first): {codes}\n{running.log_tail()}"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serving("serve", tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """`kvfleet cluster up` as its block starts it; its roles' ports are the ones it logs."""
    with serving("cluster", tmp_path_factory) as up:
        for role, host, port in re.findall(r"(\w+): gRPC on ([\d.]+):(\d+)", up.log()):
            assert host == LOCAL, up.log_tail()
            up.ports[ROLE_PORTS[role]] = int(port)
        assert set(ROLE_PORTS.values()) <= set(up.ports), up.log_tail()
        yield up


# -- what the scripts print ----------------------------------------------------------------


def _json_person(stdout: str, running: Running | None) -> None:
    person = json.loads(stdout)
    assert isinstance(person["name"], str) and isinstance(person["age"], int), person


def _samples_and_beam(stdout: str, running: Running | None) -> None:
    [samples] = [line for line in stdout.splitlines() if line.startswith("4 samples: ")]
    assert len(ast.literal_eval(samples.removeprefix("4 samples: "))) == 4, samples  # a list of 4 texts
    beam = stdout[stdout.index("best beam: "):].removeprefix("best beam: ")
    assert beam.startswith("The capital of France is") and len(beam.strip()) > len("The capital of France is"), beam


def _chat_completion(stdout: str, running: Running | None) -> None:
    response = json.loads(stdout)
    [choice] = response["choices"]
    assert response["model"] == "smollm2" and choice["message"]["content"], response
    assert 0 < response["usage"]["completion_tokens"] <= 32, response


def _grpc_tokens(stdout: str, running: Running | None) -> None:
    """The scheduler's greedy tokens, as the cluster's own gateway completes the same prompt."""
    tokens = json.loads(stdout.strip().splitlines()[-1])
    assert len(tokens) == 8 and all(isinstance(token, int) for token in tokens), tokens
    assert running is not None
    completion = httpx.post(f"{running.url}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": [504, 3575, 282, 4649, 314], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}).json()
    text = httpx.post(f"{running.url}/detokenize", timeout=60, json={"tokens": tokens}).json()["prompt"]
    assert text == completion["choices"][0]["text"], (text, completion)


CHECKS: dict[str, Callable[[str, Running | None], None]] = {
    "sdk-generate": lambda stdout, _: "Paris" in stdout or pytest.fail(stdout),
    "sdk-sampling": _samples_and_beam,
    "sdk-structured": _json_person,
    "curl-chat": _chat_completion,
    "openai-stream": lambda stdout, _: stdout.strip() or pytest.fail("nothing streamed"),
    "grpc-scheduler": _grpc_tokens,
    "planner-decision": lambda stdout, _: stdout.splitlines() == [
        "0 {'prefill': 2, 'decode': 2}", "30 {'prefill': 3, 'decode': 5}", "60 {'prefill': 3, 'decode': 5}",
        "400 {'prefill': 1, 'decode': 1}"] or pytest.fail(stdout),
}


# -- the tests ---------------------------------------------------------------------------


def test_every_code_block_is_marked_runnable_or_why_not() -> None:
    assert BLOCKS, f"no code blocks in {PAGES}?"
    unmarked = [block for block in BLOCKS if block.mark is None]
    assert not unmarked, f"mark each with <!-- runnable: id=... --> or <!-- not run: why -->: {unmarked}"
    assert all(block.note for block in BLOCKS if block.mark == "not run"), "a `not run` mark says why"
    ids = [block.id for block in RUNNABLE]
    assert all("id" in block.attrs for block in RUNNABLE) and len(ids) == len(set(ids)), ids
    for block in RUNNABLE:
        assert block.lang in ("sh", "python"), f"{block!r}: runs sh or python, not {block.lang!r}"
        assert set(block.attrs) <= {"id", "needs", "starts"}, f"{block!r}: {block.attrs}"
        for need in block.needs:
            assert need in (INFRA_PORTS if "starts" in block.attrs else SERVER_KINDS), f"{block!r}: needs {need!r}"
        if "starts" in block.attrs:
            assert block.lang == "sh" and block.attrs["starts"] in SERVER_KINDS, block
    starts = [block.attrs["starts"] for block in SERVERS]
    assert len(starts) == len(set(starts)) and {need for block in SCRIPTS for need in block.needs} <= set(starts)
    assert set(CHECKS) <= set(ids), set(CHECKS) - set(ids)


def test_the_parser_and_the_port_mapping() -> None:
    text = "<!-- not run: needs docker -->\n```sh\ndocker build .\n```\n\n```python\nx = 1\n```\n"
    marked, unmarked = code_blocks(text, "docs/page.md")
    assert (marked.mark, marked.note, marked.code, unmarked.mark, unmarked.line) == (
        "not run", "needs docker", "docker build .\n", None, 6)
    assert repr(unmarked) == "docs/page.md:6 (line-6)"
    code = 'kvfleet scheduler --port  50052 --worker-address 127.0.0.1:50051 # 8000\ncurl http://localhost:8000/v1'
    assert substitute(code, {50052: 1, 50051: 2, 8000: 3}, "t") == (
        'kvfleet scheduler --port  1 --worker-address 127.0.0.1:2 # 8000\ncurl http://localhost:3/v1')
    with pytest.raises(AssertionError, match="port 50051"):
        substitute(code, {50052: 1, 8000: 3}, "t")
    assert shell_commands("a \\\n  b # c\n\n# d\ne\n") == ["a    b # c", "e"]


@pytest.mark.parametrize("block", SCRIPTS, ids=lambda block: block.id)
def test_runnable_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    [running] = [request.getfixturevalue(need) for need in block.needs] or [None]
    code = substitute(block.code, running.ports if running else {}, repr(block))
    if block.lang == "python":
        script = tmp_path / f"{block.id}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-e", "-c", code]
    result = subprocess.run(argv, cwd=tmp_path, env=block_env(), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{block!r} exited with {result.returncode}\n{code}\n{result.stderr[-4000:]}"
    check = CHECKS.get(block.id)
    if check is not None:
        check(result.stdout, running)


def test_serve_block_serves(serve: Running) -> None:
    assert f"serving smollm2 on {serve.url} (OpenAI API: {serve.url}/v1)" in serve.log()
    assert httpx.get(f"{serve.url}/v1/models", timeout=10).json()["data"][0]["id"] == "smollm2"


def test_cluster_up_block_logs_where_each_part_listens(cluster: Running) -> None:
    # The launcher says it serves at its own next poll of /health (every 0.5 s), which
    # may come after the fixture's saw it answer.
    deadline = time.monotonic() + 5.0
    while f"cluster serving on {cluster.url}" not in cluster.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = cluster.log()
    for line in (rf"NATS on nats://{LOCAL}:\d+, Redis on redis://{LOCAL}:\d+",
                 *(rf"{role}: gRPC on {LOCAL}:\d+" for role in ROLE_PORTS),
                 re.escape(f"gateway: {cluster.url} (OpenAI API at /v1)"),
                 re.escape(f"cluster serving on {cluster.url}")):
        assert re.search(line, log), line


def test_roles_block_started_by_hand_serves(tmp_path_factory: pytest.TempPathFactory) -> None:
    block = server_block("roles")
    running = start_server(block, tmp_path_factory.mktemp("readme-roles"))
    try:
        assert len(running.processes) == 4
        response = httpx.post(f"{running.url}/v1/completions", timeout=60,
                              json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
    finally:
        codes = running.stop()
    assert codes == [0, 0, 0, 0], f"exit codes on SIGTERM, gateway first: {codes}\n{running.log_tail()}"


def test_shell_commands_split_like_a_shell() -> None:
    """The server blocks' commands parse as shell words (no stray quotes or continuations)."""
    for block in SERVERS:
        for command in shell_commands(block.code):
            assert shlex.split(command, comments=True)[0] == "kvfleet", command
