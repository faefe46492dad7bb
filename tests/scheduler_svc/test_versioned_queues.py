"""The scheduler's queues count every change (scheduler_svc/versioned_queues.py): a change
they missed would leave vllm:lora_requests_info naming adapters no request uses."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler_svc.versioned_queues import VersionedDeque, VersionedList

LIST_CHANGES: list[Callable] = [
    lambda q: q.append(9), lambda q: q.extend([9]), lambda q: q.insert(0, 9), lambda q: q.remove(1),
    lambda q: q.pop(), lambda q: q.clear(), lambda q: q.sort(), lambda q: q.reverse(),
    lambda q: q.__setitem__(0, 9), lambda q: q.__delitem__(0), lambda q: q.__iadd__([9]), lambda q: q.__imul__(2),
]
DEQUE_CHANGES: list[Callable] = [
    lambda q: q.append(9), lambda q: q.appendleft(9), lambda q: q.extend([9]), lambda q: q.extendleft([9]),
    lambda q: q.insert(0, 9), lambda q: q.remove(1), lambda q: q.pop(), lambda q: q.popleft(), lambda q: q.clear(),
    lambda q: q.rotate(1), lambda q: q.reverse(), lambda q: q.__setitem__(0, 9), lambda q: q.__delitem__(0),
    lambda q: q.__iadd__([9]), lambda q: q.__imul__(2),
]


@pytest.mark.parametrize(("kind", "change"), [(VersionedList, c) for c in LIST_CHANGES]
                         + [(VersionedDeque, c) for c in DEQUE_CHANGES])
def test_every_change_counts(kind: type, change: Callable) -> None:
    queue = kind([1, 2, 3])
    change(queue)
    assert queue.version == 1


def test_reads_do_not_count() -> None:
    running, waiting = VersionedList([1, 2]), VersionedDeque([1, 2])
    assert (list(running), running[0], len(running), 2 in running, list(waiting), waiting[0]) == ([1, 2], 1, 2, True,
                                                                                                 [1, 2], 1)
    assert running.version == waiting.version == 0
