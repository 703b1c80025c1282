"""Batch slots: which of the ``max_num_seqs`` places each running request occupies.

Slots do not change what is computed; they give schedules a stable row per place in the
batch, so traces can show when a place sits idle (static batching) or is refilled the
very next step (continuous batching).
"""

from __future__ import annotations


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Slots 0 .. the highest ever taken (lowest free first, so no more than the most
        # requests ever running at once): memory follows use, not max_num_seqs.
        self._owner: list[str | None] = []
        self._slot_of: dict[str, int] = {}

    def assign(self, request_id: str) -> int:
        if request_id in self._slot_of:
            return self._slot_of[request_id]
        assert len(self._slot_of) < self.num_slots, "the scheduler admits up to max_num_seqs"
        if None in self._owner:
            slot = self._owner.index(None)
            self._owner[slot] = request_id
        else:
            slot = len(self._owner)
            self._owner.append(request_id)
        self._slot_of[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._owner[slot] = None

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def holds(self, request_id: str) -> bool:
        return request_id in self._slot_of

    @property
    def owners(self) -> list[str | None]:
        """Each slot's request, from slot 0 up to the highest slot ever taken (the slots
        after it have never held one)."""
        return list(self._owner)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._slot_of)
