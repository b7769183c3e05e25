"""Global page table: logical page id -> (instance, frame), with per-instance free frames.

Allocation order is deterministic (lowest free frame / lowest free logical id first, LIFO on reuse) so that the
C++ core and this reference make identical decisions.
"""

from __future__ import annotations

from .spec import ClusterSpec, SchedulerError


class GlobalPageTable:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        frames = spec.frames_per_instance
        total = frames * spec.num_instances
        # Stacks: pop() yields the lowest id first on a fresh table.
        self._free_frames = [list(range(frames - 1, -1, -1)) for _ in range(spec.num_instances)]
        self._free_logical = list(range(total - 1, -1, -1))
        self.page_instance = [-1] * total  # logical page -> instance (-1 = free)
        self.page_frame = [-1] * total  # logical page -> frame on that instance

    def free_frames(self, instance: int) -> int:
        return len(self._free_frames[instance])

    def alloc(self, instance: int, n_pages: int) -> list[int]:
        """Allocate n_pages frames on `instance`; all or nothing."""
        if n_pages > len(self._free_frames[instance]):
            raise SchedulerError(
                f"instance {instance} has {len(self._free_frames[instance])} free pages, {n_pages} requested"
            )
        pages = []
        for _ in range(n_pages):
            frame = self._free_frames[instance].pop()
            logical = self._free_logical.pop()
            self.page_instance[logical] = instance
            self.page_frame[logical] = frame
            pages.append(logical)
        return pages

    def free(self, pages: list[int]) -> None:
        # Release in reverse so a free right after an alloc restores the exact previous stacks.
        for logical in reversed(pages):
            instance = self.page_instance[logical]
            if instance < 0:
                raise SchedulerError(f"double free of logical page {logical}")
            self._free_frames[instance].append(self.page_frame[logical])
            self._free_logical.append(logical)
            self.page_instance[logical] = -1
            self.page_frame[logical] = -1

    def lookup(self, logical: int) -> tuple[int, int]:
        instance = self.page_instance[logical]
        if instance < 0:
            raise SchedulerError(f"logical page {logical} is not allocated")
        return instance, self.page_frame[logical]

    def used_pages(self) -> int:
        return sum(1 for inst in self.page_instance if inst >= 0)
