"""nanocp.comm: transport-agnostic communication (torch, numpy and the standard library only).

- fabric: symmetric buffers + put/signal/wait (`InProcessFabric`, `ShmFabric`, `TorchDistFabric`)
- liveness: the abort word every shm fabric wait polls, and heartbeats (a driver detects dead or hung ranks)
- routing: Q/Res routing backend (only marked rows move, coalesced puts, per-source sequence flags)
- moe_dispatch: MoE dispatch/combine reference with DeepEP's low-latency layout
- metadata_channel (+ metadata_tcp, metadata_rdma): routing tables pushed into context buffers with a doorbell
"""

from nanocp.comm.dist_fabric import TorchDistFabric
from nanocp.comm.fabric import BufferSpec, Fabric, FabricAborted, FabricError, FabricTimeout, InProcessFabric
from nanocp.comm.metadata_channel import (
    Fault,
    FaultySender,
    FrameCheck,
    MetadataAuthError,
    MetadataCapacityError,
    MetadataChannelError,
    MetadataError,
    MetadataReceiver,
    MetadataSender,
    MetadataTimeout,
    ShmChannelInfo,
    ShmMetadataReceiver,
    ShmMetadataSender,
)
from nanocp.comm.metadata_rdma import RdmaMetadataReceiver, RdmaMetadataSender, rdma_available
from nanocp.comm.metadata_tcp import TcpMetadataReceiver, TcpMetadataSender
from nanocp.comm.moe_dispatch import DispatchHandle, LowLatencyDispatcher
from nanocp.comm.routing import PutRun, RouteStats, RoutingBackend, plan_puts
from nanocp.comm.shm_fabric import ShmFabric, ShmFabricInfo

__all__ = [
    "BufferSpec",
    "DispatchHandle",
    "Fabric",
    "FabricAborted",
    "FabricError",
    "FabricTimeout",
    "Fault",
    "FaultySender",
    "FrameCheck",
    "InProcessFabric",
    "LowLatencyDispatcher",
    "MetadataAuthError",
    "MetadataCapacityError",
    "MetadataChannelError",
    "MetadataError",
    "MetadataReceiver",
    "MetadataSender",
    "MetadataTimeout",
    "PutRun",
    "RdmaMetadataReceiver",
    "RdmaMetadataSender",
    "RouteStats",
    "RoutingBackend",
    "ShmChannelInfo",
    "ShmFabric",
    "ShmFabricInfo",
    "ShmMetadataReceiver",
    "ShmMetadataSender",
    "TcpMetadataReceiver",
    "TcpMetadataSender",
    "TorchDistFabric",
    "plan_puts",
    "rdma_available",
]
