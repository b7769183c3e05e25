"""Control plane: global scheduler, global page table, DCP placement policies, lowering into routing tables."""

from .cp_buckets import CPBucketTable
from .lowering import ExecShape, RoutingTableError, RoutingTables
from .page_table import GlobalPageTable
from .scheduler import (
    Admission,
    GlobalScheduler,
    InstanceLoad,
    IterationPlan,
    RequestState,
    StalePlanError,
)
from .spec import ClusterSpec, SchedulerError
from .waterfill import waterfill

__all__ = [
    "Admission",
    "CPBucketTable",
    "ClusterSpec",
    "ExecShape",
    "GlobalPageTable",
    "GlobalScheduler",
    "InstanceLoad",
    "IterationPlan",
    "RequestState",
    "RoutingTableError",
    "RoutingTables",
    "SchedulerError",
    "StalePlanError",
    "waterfill",
]
