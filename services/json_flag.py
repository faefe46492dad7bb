"""The JSON-object flags vLLM takes (--speculative-config, --kv-transfer-config,
--pooler-config): each arrives as the flag's text or as the SDK's dict, and each is
refused the same way when it is not an object of the keys kvfleet knows."""
from __future__ import annotations

import json
from collections.abc import Sequence


def json_object(value: str | dict, keys: Sequence[str], example: str, error: type[ValueError]) -> dict:
    """`value` as a dict naming only `keys`; else `error`, one line saying what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise error(f"not JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(value, dict):
        raise error(f"give a JSON object, such as {example}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise error(f"{', '.join(unknown)}: not supported; kvfleet takes {', '.join(keys)}")
    return value
