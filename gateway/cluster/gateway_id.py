"""A gateway's id: new for each process, so that a restarted gateway is a new one to the
schedulers. With a name (--gateway-name), `<name>.<random>`: its token stream,
kvfleet.out.<name>.<random>, is then within a NATS permission given to that name alone
(kvfleet.out.<name>.>; the Helm chart gives each gateway such a user)."""
from __future__ import annotations

import re

from services.registry import new_member_id

# One NATS subject token (no ".", "*", ">" or space), and nothing a registry key would
# split on (":").
GATEWAY_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def checked_gateway_name(name: str) -> str:
    if not GATEWAY_NAME.fullmatch(name):
        raise ValueError(f"gateway name {name!r}: letters, digits, '-' and '_' only (one NATS subject token), "
                         "at most 64")
    return name


def new_gateway_id(name: str | None = None) -> str:
    return new_member_id() if name is None else f"{checked_gateway_name(name)}.{new_member_id()}"
