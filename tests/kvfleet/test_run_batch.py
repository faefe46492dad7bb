"""`kvfleet run-batch` as a vLLM user runs it: the real console script over the real model.
What each line's answer holds is tested in process against the REST API
(tests/gateway/test_gateway.py); here, the command: stdin to stdout as the lines come,
/metrics while it runs, the exit code, and the settings refused before anything loads."""
from __future__ import annotations

import json
import select
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from kvfleet.processes import free_port
from tests.kvfleet.test_cli import ENV, KVFLEET, REPO, _assert_refused

CHAT_LINE = {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}}
LINE_TIMEOUT_S = 120.0  # the first answer waits for the model to load


def _read_line(process: subprocess.Popen, log: Path) -> dict:
    ready, _, _ = select.select([process.stdout], [], [], LINE_TIMEOUT_S)
    assert ready, log.read_text()
    line = process.stdout.readline()
    assert line, log.read_text()
    return json.loads(line)


def test_stdin_to_stdout_line_by_line_with_metrics_and_exit_1_for_a_line_that_is_not_one(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "run-batch.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [*KVFLEET, "run-batch", "-i", "-", "-o", "-", "--model", "smollm2", "--max-model-len", "256",
             "--kv-cache-memory", str(64 * 2**20), "--enable-metrics", "--port", str(port)],
            cwd=REPO, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        process.stdin.write(json.dumps(CHAT_LINE) + "\n")
        process.stdin.flush()
        # Answered while the input is still open: a line goes out as soon as it is done.
        answer = _read_line(process, log)
        assert answer["custom_id"] == "chat-1" and answer["error"] is None, answer
        assert answer["response"]["status_code"] == 200
        assert answer["response"]["body"]["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'vllm:request_success_total{finished_reason="length",model_name="smollm2"} 1.0' in metrics, metrics
        process.stdin.write("{not json\n")
        process.stdin.close()
        answer = _read_line(process, log)
        assert answer["custom_id"] is None and answer["error"].startswith("line 2: not JSON"), answer
        assert process.wait(timeout=60) == 1, log.read_text()
    finally:
        process.kill()
    assert "1 line(s) were not batch lines (lines 2)" in log.read_text()


@pytest.mark.serial  # times each refusal
def test_settings_that_cannot_work_are_one_line_and_exit_2(tmp_path: Path) -> None:
    batch = tmp_path / "in.jsonl"
    batch.write_text(json.dumps(CHAT_LINE) + "\n")
    out = str(tmp_path / "out.jsonl")
    _assert_refused(["run-batch", "-i", "https://example.com/in.jsonl", "-o", out],
                    "-i https://example.com/in.jsonl: kvfleet reads and writes local files (or - for stdin/stdout), "
                    "not URLs")
    _assert_refused(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", out],
                    f"-i {tmp_path / 'missing.jsonl'}: No such file or directory")
    _assert_refused(["run-batch", "-i", str(batch), "-o", str(tmp_path / "no" / "dir.jsonl")],
                    "No such file or directory")
    _assert_refused(["run-batch", "-o", out], "the following arguments are required: -i/--input-file")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _assert_refused(["run-batch", "-i", str(batch), "-o", out, "--enable-metrics", "--port", str(port)],
                        f"--host 127.0.0.1 --port {port}: cannot serve metrics there")
