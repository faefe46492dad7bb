"""Children start without running this process's fork handlers, and die with their launcher."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfleet.processes import spawn


def _python(code: str, **kwargs: object) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", code], env=environment, text=True, **kwargs)  # type: ignore[call-overload]


def test_a_child_starts_without_its_launchers_fork_handlers(tmp_path: Path) -> None:
    """No library's fork handler runs in the child: gRPC's aborted children before they
    could exec (SIGABRT, "epoll_wait error: Bad file descriptor"). A Python one stands
    in for them here: they run, or not, together (only on fork(), not vfork())."""
    marker = tmp_path / "fork handler ran"
    launcher = _python(
        "import os, sys\n"
        "from kvfleet.processes import spawn\n"
        f"os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'w').close())\n"
        "sys.exit(spawn(['true']).wait())\n")
    assert launcher.wait(30) == 0
    assert not marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_launcher() -> None:
    launcher = _python("import time\nfrom kvfleet.processes import spawn\n"
                       "print(spawn(['sleep', '60']).pid, flush=True)\ntime.sleep(60)\n", stdout=subprocess.PIPE)
    child = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"pid {child} outlived its launcher"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_missing_program_is_refused_at_spawn() -> None:
    with pytest.raises(FileNotFoundError):
        spawn(["kvfleet-no-such-program"])
