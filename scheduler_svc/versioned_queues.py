"""The scheduler's waiting and running queues, each counting its changes in `version`, so
that what is derived from their members (vllm:lora_requests_info's adapter names,
EngineCore.stats) is recomputed when they change, not every engine iteration."""
from __future__ import annotations

from collections import deque
from typing import Any

_LIST_CHANGES = ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
                 "__delitem__", "__iadd__", "__imul__")
_DEQUE_CHANGES = ("append", "appendleft", "extend", "extendleft", "insert", "remove", "pop", "popleft", "clear",
                  "rotate", "reverse", "__setitem__", "__delitem__", "__iadd__", "__imul__")


def _counting(base: type, names: tuple[str, ...]) -> dict[str, Any]:
    """`base`'s changing methods, each bumping `version` first."""
    def wrap(name: str) -> Any:
        method = getattr(base, name)

        def changed(self: Any, *args: Any) -> Any:
            self.version += 1
            return method(self, *args)
        return changed
    return {name: wrap(name) for name in names}


# Classes made from the method tables: a list and a deque in every other respect.
VersionedList = type("VersionedList", (list,), {"version": 0, **_counting(list, _LIST_CHANGES)})
VersionedDeque = type("VersionedDeque", (deque,), {"version": 0, **_counting(deque, _DEQUE_CHANGES)})
