"""Where the OpenAI server listens, as real process trees: `kvfleet serve --uds` and
`kvfleet cluster up --uds --api-server-count 2` answer on a Unix socket and not on a
TCP port (vLLM's --uds), /version in vLLM's shape there; the cluster's two gateways
share that one socket, each serving while the other is stopped, and /metrics,
whichever of them answers, counts what both served. SIGTERM removes the socket file."""
from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai_servers import API_KEY, MODES, PROC, SERVED, Server, alive, descendants, running_server

import kvfleet


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    uds = tmp_path_factory.mktemp("uds") / "kvfleet.sock"
    flags = ("--api-server-count", "2") if request.param == "cluster" else ()
    with running_server(request.param, tmp_path_factory, *flags, uds=uds) as running:
        yield running
    assert not uds.exists()


def _completion_tokens(server: Server) -> int:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                       http_client=server.http()) as client:
        reply = client.completions.create(model=SERVED, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    return reply.usage.completion_tokens


def test_the_server_answers_on_its_unix_socket_not_a_port(server: Server) -> None:
    with server.http() as http:
        assert http.get("/version").json() == {"version": kvfleet.__version__}
    assert _completion_tokens(server) == 4
    port = int(server.process.args[server.process.args.index("--port") + 1])  # given, and ignored as vLLM does
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))
    assert f"serving {SERVED} on unix:{server.uds}" in server.log_path.read_text()


def _gateways(server: Server) -> list[int]:
    found = []
    for pid in descendants(server.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if "kvfleet.cli" in argv and argv[argv.index("kvfleet.cli") + 1] == "gateway" and alive(pid):
            found.append(pid)
    return found


def _successes(server: Server) -> float:
    return sum(value for name, value in server.metrics().items() if name.startswith("vllm:request_success_total"))


def test_cluster_gateways_share_the_socket_and_count_together(server: Server) -> None:
    if server.mode != "cluster" or not PROC:
        pytest.skip("cluster up's gateways, seen through /proc")
    gateways = _gateways(server)
    assert len(gateways) == 2, server.log_tail()
    before = _successes(server)
    for serving in gateways:
        [paused] = [pid for pid in gateways if pid != serving]
        os.kill(paused, signal.SIGSTOP)  # it takes no connection meanwhile: `serving` answers all
        try:
            # No 503 even if `serving` has not seen the cluster yet: it takes connections once it has.
            assert _completion_tokens(server) == _completion_tokens(server) == 4
        finally:
            os.kill(paused, signal.SIGCONT)
    # Each served two: a gateway counting only its own would say 2 here.
    assert _successes(server) - before == 4
