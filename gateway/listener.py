"""Where the HTTP server listens: a TCP port (--host, --port), a Unix domain socket
(--uds, vLLM's: --host and --port are then ignored), or a listening socket inherited
from `kvfleet cluster up` (the gateway's --listen-fd), which gives the same one to each
of its --api-server-count gateways. Bound before anything loads, as vLLM binds: an
address in use is a ConfigError at once, not after a minute of loading."""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import stat

from gateway.drain import bind
from services.config import ConfigError


def listen(args: argparse.Namespace) -> socket.socket:
    """The listening socket `args` asks for; `release` it once served."""
    if getattr(args, "listen_fd", None) is not None:
        return socket.socket(fileno=args.listen_fd)
    if args.uds:
        return bind_unix(args.uds)
    return bind(args.host, args.port)


def bind_unix(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _remove_if_stale(path)
        listener.bind(path)
    except OSError as exc:
        listener.close()
        raise ConfigError(f"--uds {path}: cannot listen there: {exc.strerror}") from None
    return listener


def _remove_if_stale(path: str) -> None:
    """A socket file whose server is gone (killed before it could remove it) is removed;
    one a server still listens on, or any other file, is left for bind to refuse."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)


def release(listener: socket.socket, uds: str | None) -> None:
    """Closes `listener`; and the socket file of --uds `uds`, which bound it here."""
    listener.close()
    if uds:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(uds)
