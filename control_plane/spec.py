"""Cluster description and the errors the control plane raises for bad input."""

from __future__ import annotations

from dataclasses import dataclass


class SchedulerError(ValueError):
    """Bad input to the control plane (impossible spec, duplicate id, unplaceable request, unknown policy)."""


@dataclass(frozen=True)
class ClusterSpec:
    """`num_nodes` x `instances_per_node` DP-EP decode instances, each with a paged KV pool.

    kv_capacity_tokens is per instance; it is rounded down to whole pages of `page_size` tokens.
    """

    num_nodes: int
    instances_per_node: int
    kv_capacity_tokens: int
    page_size: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "instances_per_node", "kv_capacity_tokens", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SchedulerError(f"ClusterSpec.{name} must be a positive int, got {value!r}")
        if self.kv_capacity_tokens < self.page_size:
            raise SchedulerError(
                f"ClusterSpec.kv_capacity_tokens ({self.kv_capacity_tokens}) is smaller than one page "
                f"({self.page_size} tokens)"
            )
        if self.num_instances > 1 << 20 or self.frames_per_instance * self.num_instances >= 1 << 31:
            raise SchedulerError("ClusterSpec is too large: page ids must fit in int32")

    @property
    def num_instances(self) -> int:
        return self.num_nodes * self.instances_per_node

    @property
    def frames_per_instance(self) -> int:
        return self.kv_capacity_tokens // self.page_size

    def node_of(self, instance: int) -> int:
        return instance // self.instances_per_node

    def node_instances(self, node: int) -> range:
        first = node * self.instances_per_node
        return range(first, first + self.instances_per_node)
