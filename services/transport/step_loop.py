"""The scheduler role's engine thread: one EngineCore, stepped on its own thread,
fed by gRPC handler threads, publishing each step's deltas per gateway.

EngineCore is not thread-safe, so every call to it happens on the loop thread.
Submits and aborts arrive through a thread-safe inbox drained before each step; with
no work the thread blocks on the inbox (no busy-wait). After each iteration every
gateway with new deltas gets one batch: never one message per token.

Failure isolation: a step whose worker call fails (a lost worker among the causes)
ends the requests that step held, each with a final ABORT delta carrying the error,
and the loop goes on.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from services.config import EngineConfig
from services.engine import EngineCore, StepFailed, WorkerHandle
from services.engine_client import EngineUnavailable
from services.messages import EngineStats, TokenDelta
from services.parallel_sampling import num_children
from services.pb.kvfleet.v1 import common_pb2
from services.sampling_params import InvalidParameter, SamplingParams
from services.transport.convert import delta_to_proto
from services.transport.output_hub import OutputHub

logger = logging.getLogger(__name__)


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    gateway_id: str
    accepted: Future[None]


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Submit | _Abort | _Stop


class StepLoop:
    def __init__(
        self, config: EngineConfig, worker: WorkerHandle, hub: OutputHub, fallback_eos_token_id: int | None = None
    ) -> None:
        self.core = EngineCore(config, fallback_eos_token_id, worker=worker)
        self._hub = hub
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Guards `_stopped` together with puts, so nothing lands in the inbox after
        # the loop thread has drained it for the last time.
        self._lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None
        # Owned by the loop thread: each live request's gateway, and the deltas not yet published.
        self._gateways: dict[str, str] = {}
        self._outputs: defaultdict[str, list[common_pb2.TokenDelta]] = defaultdict(list)
        # Replaced (never mutated) by the loop thread, so any thread may read it.
        self._stats: EngineStats = self.core.stats()

    # -- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfleet-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the loop; live requests end with an ABORT delta saying so."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
        gateway_id: str,
    ) -> None:
        """Returns once the engine has queued the request. Raises InvalidParameter or
        ValueError for rejected input, EngineUnavailable once the loop is stopping."""
        accepted: Future[None] = Future()
        self._send(_Submit(request_id, list(prompt_token_ids), params, cache_salt, gateway_id, accepted))
        accepted.result()

    def abort(self, request_id: str) -> None:
        with self._lock:
            if not self._stopped:  # after a stop the loop ends every request itself
                self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def _send(self, command: _Command) -> None:
        with self._lock:
            if self._stopped:
                raise EngineUnavailable("the scheduler is shutting down")
            self._inbox.put(command)

    # -- the loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            logger.exception("the step loop died")
            raise
        finally:
            with self._lock:
                self._stopped = True
            self._close()

    def _serve(self) -> None:
        while True:
            for command in self._take_commands(block=not self.core.has_work):
                if isinstance(command, _Stop):
                    return
                if isinstance(command, _Submit):
                    self._submit(command)
                else:
                    self._abort(command.request_id)
            if self.core.has_work:
                self._step()
            self._publish()
            self._stats = self.core.stats()

    def _take_commands(self, block: bool) -> list[_Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _submit(self, command: _Submit) -> None:
        try:
            if num_children(command.params) != 1:
                # The engine would run the samples as child requests under ids of their
                # own (services/parallel_sampling.py), which this loop does not route yet.
                raise InvalidParameter("n", "parallel sampling (n or best_of > 1) is not supported over gRPC yet")
            self.core.add_request(command.request_id, command.prompt_token_ids, command.params, command.cache_salt)
        except Exception as exc:  # rejected input: the caller gets the error, the loop goes on
            command.accepted.set_exception(exc)
            return
        self._gateways[command.request_id] = command.gateway_id
        command.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        gateway_id = self._gateways.pop(request_id, None)
        if gateway_id is not None:  # else it has ended already
            self._outputs[gateway_id].append(delta_to_proto(self.core.abort_request(request_id)))

    def _step(self) -> None:
        try:
            deltas = self.core.step()
        except StepFailed as exc:  # the engine has aborted the step's requests already
            logger.error("an engine step failed, ending its %d requests: %s", len(exc.request_ids), exc.__cause__)
            for request_id in exc.request_ids:
                self._end(request_id, f"engine step failed: {exc.__cause__}")
            return
        except Exception as exc:  # the scheduler itself failed: its state is unknown
            logger.exception("the scheduler failed; ending all %d requests", len(self._gateways))
            for request_id in list(self._gateways):
                self._end(request_id, f"the scheduler failed: {exc!r}")
            return
        for delta in deltas:
            gateway_id = self._gateways[delta.request_id]
            if delta.finish_reason is not None:
                del self._gateways[delta.request_id]
            self._outputs[gateway_id].append(delta_to_proto(delta))

    def _end(self, request_id: str, error: str) -> None:
        """Ends a live request with an explicit error, whatever state the engine is in."""
        try:
            self.core.abort_request(request_id)
        except Exception:
            logger.exception("could not abort %s", request_id)
        gateway_id = self._gateways.pop(request_id)
        self._outputs[gateway_id].append(delta_to_proto(TokenDelta(request_id, [], "abort"), error))

    def _publish(self) -> None:
        if not self._outputs:
            return
        outputs, self._outputs = self._outputs, defaultdict(list)
        for gateway_id in self._hub.publish(outputs):
            # Its stream closed (the gateway left): nobody will read these requests' tokens.
            orphans = [r for r, g in self._gateways.items() if g == gateway_id]
            logger.warning("gateway %s has no output stream; aborting its %d requests", gateway_id, len(orphans))
            for request_id in orphans:
                del self._gateways[request_id]
                self.core.abort_request(request_id)

    def _close(self) -> None:
        """After the loop ends: every caller and every live request hears so."""
        for command in self._take_commands(block=False):
            if isinstance(command, _Submit):
                command.accepted.set_exception(EngineUnavailable("the scheduler is shutting down"))
        for request_id in list(self._gateways):
            self._end(request_id, "the scheduler shut down")
        self._publish()
        self._hub.close()
