"""--uds's socket file: one a dead server left is replaced, one a live server listens on
or any other file is refused in one line naming the flag."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gateway.listener import bind_unix, release
from services.config import ConfigError


def test_a_stale_socket_file_is_replaced_and_a_live_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvfleet.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # its server died: the file stays, nobody listens
    live = bind_unix(str(path))
    live.listen()
    with pytest.raises(ConfigError, match=f"--uds {path}: cannot listen there: Address already in use"):
        bind_unix(str(path))
    release(live, str(path))
    assert not path.exists()


def test_a_path_that_is_no_socket_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("kept")
    with pytest.raises(ConfigError, match="cannot listen there"):
        bind_unix(str(other))
    assert other.read_text() == "kept"
