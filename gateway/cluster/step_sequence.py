"""One scheduler's numbered messages to this gateway (StepOutputs.seq), put back in
order: duplicates dropped, early ones held until the hole before them is filled by a
replay (Scheduler.ReplayOutputs), and the hole itself made visible."""
from __future__ import annotations

from services.scheduler_messages import StepOutputs


class StepSequence:
    def __init__(self) -> None:
        self.delivered = 0  # every message up to this number has been delivered
        self.replaying = False  # a replay is under way (owned by the subscriber)
        self._held: dict[int, StepOutputs] = {}
        self._announced = 0  # the highest number the scheduler said it sent

    @property
    def has_hole(self) -> bool:
        return bool(self._held) or self._announced > self.delivered

    def accept(self, outputs: StepOutputs) -> list[StepOutputs]:
        """The messages that may be delivered now, in order (none while a hole is before them)."""
        if outputs.announce:
            self._announced = max(self._announced, outputs.seq)
        elif outputs.seq > self.delivered:
            self._held[outputs.seq] = outputs
        ready = []
        while (following := self._held.pop(self.delivered + 1, None)) is not None:
            ready.append(following)
            self.delivered += 1
        return ready

    def skip_hole(self) -> list[StepOutputs]:
        """Gives up on what is missing (the requests it carried are failed elsewhere):
        the held messages, in order, and numbering goes on after the last one known."""
        ready = [self._held[seq] for seq in sorted(self._held)]
        self.delivered = max([self.delivered, self._announced, *self._held])
        self._held.clear()
        return ready
