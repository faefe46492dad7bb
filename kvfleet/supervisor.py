"""Keeps the processes of `cluster up` running: one that exits on its own is started
again, with a backoff that doubles from 1 s to 30 s while it keeps failing soon after
its start (and resets once it has run for a minute), and every exit and restart is
logged. Only the launcher's own shutdown stops them, or a process that exits with
code 2: a configuration error, which a restart would only repeat."""
from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("kvfleet.cluster")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
CONFIG_ERROR_EXIT = 2  # what kvfleet's commands (and argparse) exit with on a setting that cannot work
HEALTHY_RUN_S = 60.0  # a run this long counts as recovered: the next failure waits FIRST_BACKOFF_S again


@dataclass
class Supervised:
    name: str
    start: Callable[[], subprocess.Popen]
    process: subprocess.Popen | None = None
    restarts: int = 0
    _started_at: float = 0.0
    _backoff_s: float = FIRST_BACKOFF_S
    _restart_at: float | None = field(default=None)

    @property
    def misconfigured(self) -> bool:
        return self.process is not None and self.process.poll() == CONFIG_ERROR_EXIT

    def launch(self) -> None:
        self.adopt(self.start())

    def adopt(self, process: subprocess.Popen) -> None:
        """Supervises `process`, started elsewhere, as if `launch` had started it."""
        self.process = process
        self._started_at = time.monotonic()

    def check(self) -> None:
        """Call periodically: restarts the process once its backoff has passed."""
        now = time.monotonic()
        if self._restart_at is None:
            if self.process is None or self.process.poll() is None:
                return
            if now - self._started_at >= HEALTHY_RUN_S:
                self._backoff_s = FIRST_BACKOFF_S
            self._restart_at = now + self._backoff_s
            logger.error("%s exited with code %s; restarting it in %.0f s", self.name, self.process.returncode,
                         self._backoff_s)
            self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
        elif now >= self._restart_at:
            self._restart_at = None
            self.restarts += 1
            self.launch()
            logger.info("%s restarted (pid %d, restart %d)", self.name, self.process.pid, self.restarts)
