"""How the routed experts are split over the decode instances (expert parallelism)."""

from __future__ import annotations


def expert_slots(num_experts: int, num_instances: int) -> int:
    """Expert slots per instance: experts are split in contiguous ranges of ceil(E / N); when N does not divide E
    (e.g. after the EP group shrank to the survivors of a failure) the last ranges hold padding slots that the
    gate never chooses."""
    return -(-num_experts // num_instances)


def owned_experts(rank: int, num_instances: int, num_experts: int) -> range:
    slots = expert_slots(num_experts, num_instances)
    return range(min(rank * slots, num_experts), min((rank + 1) * slots, num_experts))
