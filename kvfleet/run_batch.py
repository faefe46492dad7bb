"""`kvfleet run-batch -i input.jsonl -o output.jsonl`: vLLM's batch runner. Each line of an
OpenAI Batch file (chat or completions) is answered by the embedded engine and the
gateway's own app (gateway/batch.py), one output line per input line, in input order.

Lines run concurrently, up to twice --max-num-seqs at once as vLLM's runner does, so the
engine batches them continuously; a line's error is its own output line, and the others
go on. The command takes `serve`'s flags (the same engine, the same app); --host and
--port are where --enable-metrics serves Prometheus' /metrics, as in vLLM's runner.
Files are local paths, or `-` for stdin and stdout; URLs are refused (vLLM fetches and
uploads them over HTTP: fetch the file first, upload the output after).

Exit code: 0 when every line was a batch line (each may still hold an error answer), 1
when some were not (not JSON, no custom_id, ...: they are answered too, and named on
stderr), 2 for a setting that cannot work, before anything loads.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterable
from typing import IO, TYPE_CHECKING

from services.cli_args import engine_args
from services.config import ConfigError, EngineConfig
from services.telemetry import configure_logging

if TYPE_CHECKING:
    from prometheus_client.registry import Collector
    from starlette.types import ASGIApp

    from gateway.batch import BatchAnswer

logger = logging.getLogger("kvfleet.run_batch")

# vLLM's bound on lines in flight, per --max-num-seqs: enough to keep every engine slot busy.
IN_FLIGHT_PER_SEQ = 2
PROGRESS_EVERY_S = 10.0
_READ_HINT = 1 << 16  # bytes of lines read at a time


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's runner flags, besides `serve`'s (which the caller adds)."""
    parser.add_argument("-i", "--input-file", required=True,
                        help="the OpenAI Batch file: a JSON line per request; - reads stdin")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the answers go, a JSON line per input line in its order; - writes stdout")
    parser.add_argument("--enable-metrics", action="store_true",
                        help="serve Prometheus /metrics on --host:--port while the batch runs")
    # `serve`'s address flags mean the metrics server's here, as in vLLM's runner.
    for action in parser._actions:
        if action.dest in ("host", "port"):
            action.help = f"the {action.dest} --enable-metrics serves /metrics on (default: %(default)s)"


def _open(path: str, mode: str, flag: str) -> IO[str]:
    if path == "-":
        return sys.stdin if mode == "r" else sys.stdout
    if path.startswith(("http://", "https://")):
        raise ConfigError(f"{flag} {path}: kvfleet reads and writes local files (or - for stdin/stdout), not "
                          "URLs; download the input first, upload the output after")
    try:
        return open(path, mode, encoding="utf-8")  # run_batch closes it
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror}") from None


class _Deferred:
    """A Prometheus collector for a registry that exists only once the app is built:
    the metrics port is taken before anything loads (a busy one fails at once)."""

    registry: Collector | None = None

    def collect(self) -> Iterable:
        return self.registry.collect() if self.registry is not None else ()


def run_batch(args: argparse.Namespace) -> int:
    configure_logging()
    config = EngineConfig(**engine_args(args))
    source, sink = _open(args.input_file, "r", "-i"), _open(args.output_file, "w", "-o")
    metrics = _Deferred()
    if args.enable_metrics:
        from prometheus_client import start_http_server

        try:
            start_http_server(args.port, addr=args.host, registry=metrics)
        except OSError as exc:
            raise ConfigError(f"--host {args.host} --port {args.port}: cannot serve metrics there: "
                              f"{exc.strerror}") from None
    from kvfleet.serve import embedded_app

    app, engine = embedded_app(args, config)
    metrics.registry = app.state.gateway.metrics.registry
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    engine.start()
    try:
        malformed = asyncio.run(answer_all(app, _lines(source), sink, IN_FLIGHT_PER_SEQ * config.max_num_seqs, headers))
    except (OSError, UnicodeDecodeError) as exc:  # the input broke off: what was answered stays written
        logger.error("run-batch: reading %s failed: %s", args.input_file, exc)
        return 1
    finally:
        engine.shutdown()
        for file in (source, sink):
            if file not in (sys.stdin, sys.stdout):
                file.close()
    if malformed:
        logger.error("run-batch: %d line(s) were not batch lines (lines %s); their answers say why",
                     len(malformed), ", ".join(map(str, malformed[:20])) + (" ..." if len(malformed) > 20 else ""))
        return 1
    return 0


def _read_some(source: IO[str]) -> list[str]:
    """The next lines of a file, a chunk at a time; of a pipe, the next line alone, so a
    line is answered as soon as it comes."""
    if source.seekable():
        return source.readlines(_READ_HINT)
    line = source.readline()
    return [line] if line else []


async def _lines(source: IO[str]) -> AsyncIterator[tuple[int, str]]:
    """(line number, text) of the input's non-blank lines, read off the event loop: a
    slow stdin must not stall the lines in flight."""
    number = 0
    while chunk := await asyncio.to_thread(_read_some, source):
        for text in chunk:
            number += 1
            if text.strip():
                yield number, text


async def answer_all(
    app: ASGIApp, lines: AsyncIterator[tuple[int, str]], sink: IO[str], max_in_flight: int,
    headers: dict[str, str] | None = None,
) -> list[int]:
    """Answers every line, at most `max_in_flight` at a time, writing the answers in the
    lines' order as they come. Returns the numbers of the lines that were not batch lines."""
    from gateway.batch import answer_line

    slots = asyncio.Semaphore(max_in_flight)  # taken by a line as it starts, given back once it is written
    queue: asyncio.Queue[tuple[int, asyncio.Task[BatchAnswer]] | None] = asyncio.Queue()
    malformed: list[int] = []
    started = last_report = time.monotonic()
    answered = failed = 0

    async def read() -> None:
        try:
            async for number, text in lines:
                await slots.acquire()
                queue.put_nowait((number, asyncio.create_task(answer_line(app, number, text, headers))))
        finally:
            queue.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (item := await queue.get()) is not None:
            number, task = item
            answer = await task
            sink.write(answer.line + "\n")
            sink.flush()
            slots.release()
            answered += 1
            failed += not answer.ok
            if answer.malformed:
                malformed.append(number)
            if time.monotonic() - last_report > PROGRESS_EVERY_S:
                last_report = time.monotonic()
                logger.info("run-batch: %d lines answered", answered)
        await reader  # the input's own errors (an unreadable file) end the run
    finally:
        reader.cancel()
        while not queue.empty():  # an interrupted run: nothing keeps generating
            if (item := queue.get_nowait()) is not None:
                item[1].cancel()
    logger.info("run-batch: %d lines answered (%d with an error) in %.1f s", answered, failed,
                time.monotonic() - started)
    return malformed
