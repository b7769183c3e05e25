"""A decode cluster on Ray: one actor per DecodeInstance, kept together per node by placement groups.

Same interface as ThreadCluster / ProcessCluster (run_iteration, write_kv, timing_records, close), so the Engine
drives it unchanged. Instance r belongs to node group r // instances_per_node; each group is one STRICT_PACK
placement group (one bundle per instance: 1 GPU on a GPU cluster, CPUs otherwise), so a node's instances share a
host as the scheduler's ClusterSpec assumes. The KV pools live in the actors: prefill's `write_kv` is an actor
call. The fabric between actors is shared memory (ShmFabric) when every actor is on one host, else
torch.distributed over gloo (TorchDistFabric); `fabric="dist"` forces the latter. The gloo group meets in a store
that rank 0's actor serves behind the cluster-token handshake of the TCP metadata channel (comm/auth_store.py): a
random token per cluster, handed to the actors through Ray, so a stranger reaching the rendezvous port gets nothing.

The decode math runs on the actor's CPU: the data plane's tensors and fabrics are host memory today, so on a GPU
cluster each actor reserves its GPU (placement, isolation) while computing with the reference CPU path.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import numpy as np
import torch

from nanocp.comm.fabric import FabricTimeout
from nanocp.comm.shm_fabric import ShmFabric, ShmFabricInfo
from nanocp.control_plane.lowering import RoutingTables

from .block_store import StaleBlockTableError
from .cluster import ClusterConfig, FullTables, InstanceFailure, TableFeed, allocate_pools, build_instance
from .instance import RowInput, fabric_flags
from .row_messages import RowBatch, SampledRows, pack_outputs, pack_rows, unpack_rows
from .timing import PhaseRecord

FABRICS = ("auto", "shm", "dist")
log = logging.getLogger("nanocp.ray")


@dataclass(frozen=True)
class RayPlacement:
    """Where the instances go: `instances_per_node` per placement group, each with its own resources."""

    instances_per_node: int
    gpus_per_instance: float = 0.0  # 1 on a GPU cluster
    cpus_per_instance: float = 1.0
    fabric: str = "auto"  # auto | shm | dist
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.instances_per_node, int) or self.instances_per_node < 1:
            raise ValueError(f"instances_per_node must be an int >= 1, got {self.instances_per_node!r}")
        if self.fabric not in FABRICS:
            raise ValueError(f"unknown fabric {self.fabric!r}; choose one of {FABRICS}")
        if self.gpus_per_instance < 0 or self.cpus_per_instance <= 0:
            raise ValueError("gpus_per_instance must be >= 0 and cpus_per_instance > 0")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus_per_instance}
        if self.gpus_per_instance:
            b["GPU"] = self.gpus_per_instance
        return b


@dataclass(frozen=True)
class ActorLocation:
    node_id: str
    ip: str
    pid: int


class InstanceActor:
    """Body of one Ray actor: a DecodeInstance with its own KV pool (wrapped with ray.remote by RayCluster)."""

    def __init__(self, cfg: ClusterConfig, rank: int) -> None:
        torch.set_num_threads(1)
        self.cfg, self.rank = cfg, rank
        self.instance = None
        self.fabric = None
        self.distributed = False
        self.store_server = None

    def location(self) -> ActorLocation:
        import ray

        return ActorLocation(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def serve_rendezvous(self, token: bytes, single_host: bool) -> int:
        """Rank 0: serve the gloo group's rendezvous store to peers that prove `token`; returns its port."""
        from nanocp.comm.auth_store import AuthStoreServer

        self.store_server = AuthStoreServer(token, host="127.0.0.1" if single_host else "0.0.0.0")
        return self.store_server.port

    def start(self, fabric: str, arg: ShmFabricInfo | tuple[str, int, bytes], single_host: bool) -> str:
        """Join the fabric (collective: every actor starts concurrently) and build the instance.

        Returns "ok", or "retry" when the shared-memory fabric saw a peer's segment before the peer had sized
        it (ShmFabric's attach raises ValueError on an empty segment): the driver then starts over."""
        cfg = self.cfg
        if fabric == "shm":
            try:
                self.fabric = ShmFabric(arg, self.rank)
            except ValueError:
                return "retry"
        else:
            import torch.distributed as dist

            from nanocp.comm.auth_store import AuthStore
            from nanocp.comm.dist_fabric import TorchDistFabric

            if single_host:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            host, port, token = arg
            store = AuthStore((host, port), token)
            dist.init_process_group(
                "gloo", store=store, rank=self.rank, world_size=cfg.num_instances, timeout=timedelta(seconds=120)
            )
            self.distributed = True
            self.fabric = TorchDistFabric(num_flags=fabric_flags(cfg.num_instances))
        pool = allocate_pools(replace(cfg, num_instances=1), shared=False)[0]  # this instance's pool only
        self.instance = build_instance(cfg, self.rank, self.fabric, pool)
        return "ok"

    def run_iteration(self, table: np.ndarray, rows: RowBatch, return_logits: bool) -> tuple:
        """rows: `pack_rows` of the instance's RowInputs -> ("ok", pack_outputs(outputs), timing records),
        ("stale", text) when the instance refused an incremental table its block-table store cannot apply (before
        any exchange), or ("error", text, is_fabric_timeout)."""
        try:
            out = self.instance.run_iteration(RoutingTables.parse(table), unpack_rows(rows), return_logits)
        except StaleBlockTableError as e:
            return ("stale", str(e))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            return ("error", f"{type(e).__name__}: {e}", isinstance(e, FabricTimeout))
        records, self.instance.timing.records = self.instance.timing.records, []
        return ("ok", pack_outputs(out), records)

    def write_kv(self, frames: list[int], start_slot: int, kv: torch.Tensor) -> None:
        self.instance.pool.write_range(frames, start_slot, kv)

    def close(self) -> None:
        """Collective for the dist fabric: every actor closes concurrently."""
        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None
        if self.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.distributed = False
        if self.store_server is not None:
            self.store_server.close()
            self.store_server = None


@dataclass
class _Handles:
    groups: list = field(default_factory=list)  # placement groups, one per node group
    actors: list = field(default_factory=list)
    shm: ShmFabricInfo | None = None
    shm_node: str = ""  # node whose /dev/shm holds the session


class RayCluster:
    """N Ray actors; needs `ray.init(...)` to have been called (the deploy command does it)."""

    START_ATTEMPTS = 3  # only the shared-memory attach race (see InstanceActor.start) is retried
    incremental_tables = True  # run_iteration takes full_tables (data_plane/cluster.py, TableFeed)
    instances_in_other_processes = True  # actors: the driver thread may run as SCHED_BATCH (nanocp/driver_policy.py)

    def __init__(
        self, cfg: ClusterConfig, placement: RayPlacement | None = None, allow_one_group: bool = False
    ) -> None:
        """allow_one_group: when the instances do not fill whole placement groups (the survivors of a failure,
        as the Engine rebuilds its cluster), put them all in one group instead of refusing."""
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayCluster needs a connected Ray runtime: call ray.init(...) first")
        placement = placement or RayPlacement(cfg.num_instances)
        if cfg.num_instances % placement.instances_per_node:
            if not allow_one_group:
                raise ValueError(
                    f"{cfg.num_instances} instances do not fill whole nodes of {placement.instances_per_node}"
                )
            placement = replace(placement, instances_per_node=cfg.num_instances)  # survivors form one node
        self.cfg, self.placement = cfg, placement
        self._h = _Handles()
        self._records: list[PhaseRecord] = []
        self.feed = TableFeed(cfg.num_instances)
        self._broken = False  # the last iteration failed
        self._closed = False
        self.locations: list[ActorLocation] = []
        self.fabric = ""
        try:
            for _ in range(self.START_ATTEMPTS):
                if self._start():
                    break
                self._teardown()
            else:
                raise InstanceFailure(f"shared-memory fabric did not start in {self.START_ATTEMPTS} attempts")
        except BaseException:
            self.close()
            raise

    # ---- startup ------------------------------------------------------------------------------------------

    def _start(self) -> bool:
        import ray

        self._place()
        self.locations = ray.get([a.location.remote() for a in self._h.actors], timeout=self.placement.start_timeout_s)
        self.fabric = self._choose_fabric()
        return self._start_instances()

    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p, n = self.placement, self.cfg.num_instances
        for _ in range(n // p.instances_per_node):
            self._h.groups.append(placement_group([p.bundle()] * p.instances_per_node, strategy="STRICT_PACK"))
        for g, group in enumerate(self._h.groups):
            if not group.wait(p.start_timeout_s):
                raise InstanceFailure(
                    f"placement group {g} ({p.instances_per_node} x {p.bundle()}) could not be placed within "
                    f"{p.start_timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}"
                )
        actor_cls = ray.remote(InstanceActor)
        for rank in range(n):
            group = self._h.groups[rank // p.instances_per_node]
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank % p.instances_per_node)
            # Two threads: a liveness probe (location) answers while an iteration waits on the fabric; the driver
            # itself never runs two iterations of one actor at once.
            options = dict(
                num_cpus=p.cpus_per_instance,
                num_gpus=p.gpus_per_instance,
                scheduling_strategy=strategy,
                max_concurrency=2,
            )
            self._h.actors.append(actor_cls.options(**options).remote(self.cfg, rank))

    @property
    def single_host(self) -> bool:
        return len({loc.node_id for loc in self.locations}) == 1

    def _choose_fabric(self) -> str:
        if self.placement.fabric == "shm" and not self.single_host:
            raise ValueError("fabric 'shm' needs every instance on one host; use 'dist' or 'auto'")
        if self.placement.fabric == "auto":
            return "shm" if self.single_host else "dist"
        return self.placement.fabric

    def _start_instances(self) -> bool:
        """Start every instance; False if the shared-memory fabric must be set up again."""
        import ray

        actors = self._h.actors
        if self.fabric == "shm":
            self._h.shm = ShmFabric.new_session(self.cfg.num_instances, fabric_flags(self.cfg.num_instances))
            self._h.shm_node = self.locations[0].node_id
            arg = self._h.shm
        else:
            token = secrets.token_bytes(32)  # this cluster's: the actors get it through Ray, never over the port
            port = ray.get(actors[0].serve_rendezvous.remote(token, self.single_host))
            host = "127.0.0.1" if self.single_host else self.locations[0].ip
            arg = (host, port, token)
        pending = [a.start.remote(self.fabric, arg, self.single_host) for a in actors]
        deadline = time.monotonic() + self.placement.start_timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise InstanceFailure(f"decode instances did not start within {self.placement.start_timeout_s:.0f} s")
            try:
                status = ray.get(done[0])
            except ray.exceptions.RayError as e:
                raise InstanceFailure(f"decode instances failed to start: {e}") from e
            if status == "retry":
                return False
        return True

    # ---- the cluster interface ----------------------------------------------------------------------------

    @property
    def num_instances(self) -> int:
        return self.cfg.num_instances

    def run_iteration(
        self,
        tables: list[np.ndarray],
        rows: list[dict[int, RowInput]],
        return_logits: bool = False,
        full_tables: FullTables | None = None,
    ) -> SampledRows:
        """One iteration on every actor. Incremental tables go to instances whose block-table store is known to
        hold their base (TableFeed); a refused one is resent as its full snapshot while the peers wait for it."""
        import ray

        actors = self._h.actors
        sent = [self.feed.pick(r, tables, full_tables) for r in range(len(actors))]
        packed = [pack_rows(r) for r in rows]
        pending = {actors[r].run_iteration.remote(sent[r], packed[r], return_logits): r for r in range(len(actors))}
        results: list[SampledRows | None] = [None] * len(actors)
        errors: list[tuple[bool, str]] = []  # (is a fabric timeout, message)
        deadline = time.monotonic() + self.cfg.timeout_s * 2 + 5
        while pending:  # in completion order
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                errors += [(False, f"instance {r}: no answer within the iteration deadline") for r in pending.values()]
                break
            r = pending.pop(done[0])
            try:
                msg = ray.get(done[0])
            except ray.exceptions.RayActorError as e:  # dead: its peers only wait for it to time out
                errors.append((False, f"instance {r}: {type(e).__name__}: {e}"))
                break
            except ray.exceptions.RayError as e:
                errors.append((False, f"instance {r}: {type(e).__name__}: {e}"))
                continue
            if msg[0] == "ok":
                results[r] = msg[1]
                self._records.extend(msg[2])
            elif msg[0] == "stale" and TableFeed.can_resend_full(sent[r], full_tables):
                sent[r] = full_tables()[r]
                pending[actors[r].run_iteration.remote(sent[r], packed[r], return_logits)] = r
            else:
                errors.append((msg[0] == "error" and msg[2], f"instance {r}: {msg[1]}"))
        if errors:
            self.feed.forget()
            self._broken = True
            real = [text for is_timeout, text in errors if not is_timeout] or [errors[0][1]]
            raise InstanceFailure(f"decode iteration failed: {real[0]}")
        self._broken = False
        for r, table in enumerate(sent):
            self.feed.held_now(r, table)
        return SampledRows.concat(results)

    def write_kv(self, instance: int, frames: list[int], start_slot: int, kv: torch.Tensor) -> None:
        """kv [L, n, Dkv] -> slots start_slot.. of a shard whose pages are `frames` on `instance` (an actor call)."""
        import ray

        try:
            ray.get(
                self._h.actors[instance].write_kv.remote(list(frames), start_slot, kv.contiguous()),
                timeout=self.cfg.timeout_s,
            )
        except ray.exceptions.RayError as e:
            raise InstanceFailure(f"writing KV into instance {instance} failed: {e}") from e

    def timing_records(self) -> list[PhaseRecord]:
        records, self._records = self._records, []
        return records

    def dead_instances(self, timeout_s: float = 5.0) -> list[int]:
        """Instances whose actor has died (a busy actor that does not answer in time is not counted)."""
        import ray

        refs = [a.location.remote() for a in self._h.actors]
        dead = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except ray.exceptions.GetTimeoutError:
                pass
        return dead

    def kill_instance(self, instance: int) -> None:
        """Fault injection (tests, reliability runs): kill one instance's actor."""
        import ray

        ray.kill(self._h.actors[instance], no_restart=True)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the fabrics (collectively), kill the actors, remove the placement groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        # After a failed iteration the survivors may sit in fabric waits for a dead peer: no collective close then.
        if self._h.actors and not self._broken:
            try:
                ray.get([a.close.remote() for a in self._h.actors], timeout=timeout_s)
            except ray.exceptions.RayError as e:  # a dead actor cannot close; every actor is killed below anyway
                log.warning("closing the Ray decode instances: %s", e)
        self._teardown()

    def _teardown(self) -> None:
        """Kill the actors, remove the placement groups, unlink what is left of a shared-memory session."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self._h.actors:
            ray.kill(a, no_restart=True)
        for group in self._h.groups:
            remove_placement_group(group)
        if self._h.shm is not None:
            _cleanup_shm(self._h.shm, self._h.shm_node)
        self._h = _Handles()


def _cleanup_shm(info: ShmFabricInfo, node_id: str) -> None:
    """ShmFabric.cleanup on the node that held the session (here, or through a task pinned to that node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if ray.get_runtime_context().get_node_id() == node_id:
        ShmFabric.cleanup(info)
        return
    task = ray.remote(num_cpus=0)(ShmFabric.cleanup)
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    ray.get(task.options(scheduling_strategy=strategy).remote(info), timeout=60)
