"""A local decode cluster: N DecodeInstances as threads in this process or as one process each.

The driver (nanocp.LLM, the server) owns the KV pools' memory, so prefill can write a prompt's KV straight into
the pages the scheduler chose, and hands each instance its routing table and the inputs of its MoE rows every
iteration. Instances exchange queries, partial results and MoE tokens over the fabric (in-process or shared
memory). Every fabric wait has a timeout: a dead or stuck instance surfaces as an error, never a hang. The
processes backend is data_plane/process_cluster.py (it also detects a dead or hung instance at once).

Routing tables carry incremental block tables (control_plane/lowering.py). `run_iteration(tables, rows,
full_tables=plan.full_tables)` sends an instance its incremental table only when its block-table store is known to
hold the table that one builds on; otherwise (a fresh cluster, an instance whose last iteration failed) and when an
instance refuses a table as stale, it sends the full snapshot. Without `full_tables` the tables go out as given.
Each instance's row inputs come as a `RowBatch` (or a dict of RowInputs) and the sampled rows go back as
`SampledRows`: columns, without an object per row on the driver (data_plane/row_messages.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import numpy as np
import torch

from nanocp.comm.fabric import FabricTimeout, InProcessFabric
from nanocp.control_plane.lowering import BASE_SEQ_SLOT, FULL_SLOT, RoutingTables
from nanocp.models import load_config, load_model

from .block_store import StaleBlockTableError
from .decode_layers import DecodeWeights
from .experts import owned_experts
from .graph_runner import build_graph_engine
from .instance import DecodeInstance, Handoff, InstanceLimits, RowOutput, fabric_flags
from .kv_pool import PagedKVPool
from .row_messages import Rows, SampledRows, pack_outputs, unpack_rows
from .timing import PhaseRecord, TimingLog

BACKENDS = ("inline", "threads", "processes", "ray")


class InstanceFailure(RuntimeError):
    """An instance raised or died during an iteration."""


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    num_instances: int
    limits: InstanceLimits
    frames_per_instance: int
    page_size: int
    dtype: torch.dtype = torch.float32
    timeout_s: float = 30.0
    timing: bool = False
    table_capacity_bytes: int = 8 << 20  # metadata channel context buffer per instance (processes backend)
    metadata_timeout_s: float = 2.0  # an instance waits this long for its table before asking for a resend
    metadata_retries: int = 3
    use_graphs: bool = False  # AOT graph engine: static buckets and pool (CUDA graphs on GPU, eager replay on CPU)
    # Processes backend: an instance whose heartbeat stops for this long (stopped, wedged) is killed and handled as
    # dead (data_plane/process_cluster.py).
    heartbeat_timeout_s: float = 3.0
    # Where the instances' weights, KV pools and fabric buffers live. "cuda[:i]": every instance of this process
    # shares that GPU (inline and threads backends; instances in other processes stay on the CPU).
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {self.device!r} (accepted: 'cpu', 'cuda', 'cuda:<index>')") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {self.device!r} (accepted: 'cpu', 'cuda', 'cuda:<index>')")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} needs CUDA, which this machine does not have (use 'cpu')")


def experts_of(rank: int, num_instances: int, num_experts: int) -> set[int]:
    return set(owned_experts(rank, num_instances, num_experts))


def build_instance(
    cfg: ClusterConfig, rank: int, fabric, pool: PagedKVPool, shared: DecodeWeights | None = None
) -> DecodeInstance:
    """Instance `rank` with its experts; `shared`: prepared replicated weights of instances in this process."""
    config = load_config(cfg.model)
    experts = experts_of(rank, cfg.num_instances, config.n_routed_experts)
    model = load_model(cfg.model, expert_ids=experts, dtype=cfg.dtype, device=cfg.device)
    timing = TimingLog(enabled=cfg.timing)
    graphs = None
    if cfg.use_graphs:
        graphs = build_graph_engine(
            config, cfg.limits, cfg.num_instances, pool.frames, cfg.page_size, cfg.dtype, device=cfg.device
        )
    return DecodeInstance(rank, model, pool, fabric, cfg.limits, cfg.timeout_s, timing, graphs=graphs, shared=shared)


def shared_weights(cfg: ClusterConfig) -> DecodeWeights:
    """The replicated (attention, dense, shared-expert, gate, embedding, head) weights, prepared once for every
    instance of one process: each instance adds only its routed experts. On CPU the instances then read one copy
    (a quarter of the cache footprint with 4 instances), as GPUs of a DP group each read their own."""
    return DecodeWeights.build(load_model(cfg.model, expert_ids=set(), dtype=cfg.dtype, device=cfg.device))


def allocate_pools(cfg: ClusterConfig, shared: bool) -> list[PagedKVPool]:
    c = load_config(cfg.model)
    return [
        PagedKVPool.allocate(
            # The graph path keeps one scratch frame past the scheduler's frames for padding rows to write to.
            c.num_hidden_layers,
            cfg.frames_per_instance + (1 if cfg.use_graphs else 0),
            cfg.page_size,
            c.kv_cache_dim,
            cfg.dtype,
            shared,
            cfg.device,
        )
        for _ in range(cfg.num_instances)
    ]


FullTables = Callable[[], list[np.ndarray]]


class TableFeed:
    """Which routing table each instance gets: the incremental one when the instance's block-table store is known
    to hold the table it builds on, else the full snapshot. The driver learns a store's state from the iterations
    that succeeded; a failed iteration leaves it unknown."""

    def __init__(self, num_instances: int) -> None:
        self.held: list[int | None] = [None] * num_instances  # per instance: sequence of the table its store holds

    def pick(self, r: int, tables: list[np.ndarray], full_tables: FullTables | None) -> np.ndarray:
        table = tables[r]
        if full_tables is None or self.held[r] == int(table[BASE_SEQ_SLOT]):
            return table
        return full_tables()[r]

    @staticmethod
    def can_resend_full(table: np.ndarray, full_tables: FullTables | None) -> bool:
        """A stale incremental table can be replaced by its full snapshot (a full one is never stale)."""
        return full_tables is not None and not int(table[FULL_SLOT])

    def held_now(self, r: int, table: np.ndarray) -> None:
        self.held[r] = int(table[3])  # the table's sequence (its iteration)

    def forget(self) -> None:
        self.held = [None] * len(self.held)


def _first_real_error(errors: list[BaseException]) -> BaseException:
    """The root cause: a peer's timeout is a consequence of another instance's failure."""
    real = [e for e in errors if not isinstance(e, FabricTimeout)]
    return (real or errors)[0]


class _LocalPools:
    """Clusters whose KV pools live in this process's (shared) memory: prefill writes them directly."""

    pools: list[PagedKVPool]

    def write_kv(self, instance: int, frames: list[int], start_slot: int, kv: torch.Tensor) -> None:
        """kv [L, n, Dkv] -> slots start_slot.. of a shard whose pages are `frames` on `instance` (a KV sink)."""
        self.pools[instance].write_range(frames, start_slot, kv)


class _InProcessCluster(_LocalPools):
    """Instances of this process on one in-process fabric (the inline and the threaded cluster)."""

    incremental_tables = True  # run_iteration takes full_tables (see the module docstring)

    def __init__(self, cfg: ClusterConfig, executor: ThreadPoolExecutor) -> None:
        self.cfg = cfg
        self.feed = TableFeed(cfg.num_instances)
        self.pools = allocate_pools(cfg, shared=False)
        fabrics = InProcessFabric.create(
            cfg.num_instances, num_flags=fabric_flags(cfg.num_instances), device=cfg.device
        )
        shared = shared_weights(cfg)
        # Buffer registration is collective (it ends in a barrier): build every instance concurrently.
        futures = [
            executor.submit(build_instance, cfg, r, fabrics[r], self.pools[r], shared) for r in range(cfg.num_instances)
        ]
        self.instances = [f.result() for f in futures]

    def timing_records(self) -> list[PhaseRecord]:
        records = [r for inst in self.instances for r in inst.timing.records]
        for inst in self.instances:
            inst.timing.records.clear()
        return records

    def dead_instances(self) -> list[int]:
        return []  # instances of this process do not die alone: a failure here is an error, not a lost instance

    def close(self) -> None:
        for inst in self.instances:
            inst.fabric.close()


class ThreadCluster(_InProcessCluster):
    """One thread per instance, an in-process fabric between them."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self._executor = ThreadPoolExecutor(cfg.num_instances, thread_name_prefix="nanocp-instance")
        super().__init__(cfg, self._executor)

    def run_iteration(
        self,
        tables: list[np.ndarray],
        rows: list[Rows],
        return_logits: bool = False,
        full_tables: FullTables | None = None,
    ) -> SampledRows:
        sent = [self.feed.pick(r, tables, full_tables) for r in range(len(self.instances))]
        inputs = [unpack_rows(r) for r in rows]

        def submit(r: int):
            return self._executor.submit(
                self.instances[r].run_iteration, RoutingTables.parse(sent[r]), inputs[r], return_logits
            )

        pending = {submit(r): r for r in range(len(self.instances))}
        results: list[list[RowOutput]] = [[] for _ in self.instances]
        errors = []
        while pending:  # in completion order: a refused table is resent while its peers wait for it
            done, _ = futures_wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                r = pending.pop(future)
                try:
                    results[r] = future.result()
                except StaleBlockTableError as e:  # refused before any exchange
                    if TableFeed.can_resend_full(sent[r], full_tables):
                        sent[r] = full_tables()[r]
                        pending[submit(r)] = r
                    else:
                        errors.append(e)
                except Exception as e:  # noqa: BLE001 - collected and re-raised with the root cause
                    errors.append(e)
        if errors:
            self.feed.forget()
            raise InstanceFailure(f"decode iteration failed: {_first_real_error(errors)!r}") from errors[0]
        for r, table in enumerate(sent):
            self.feed.held_now(r, table)
        return pack_outputs([out for result in results for out in result])

    def close(self) -> None:
        super().close()
        self._executor.shutdown(wait=True)


class InlineCluster(_InProcessCluster):
    """Every instance in this thread, driven cooperatively: each instance's iteration is a generator that yields at
    every exchange; the driver resumes whichever instance's wait is satisfied. Same instance code and fabric as
    the threaded cluster, without thread switches: the fastest way to run a local cluster on a few CPU cores.
    A round in which no instance can move is a deadlock and raises at once (it never hangs)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        with ThreadPoolExecutor(cfg.num_instances) as builders:  # threads only to build (registration is collective)
            super().__init__(cfg, builders)

    def run_iteration(
        self,
        tables: list[np.ndarray],
        rows: list[Rows],
        return_logits: bool = False,
        full_tables: FullTables | None = None,
        handoffs: list[list[Handoff]] | None = None,
    ) -> SampledRows:
        """`handoffs`: per instance, kept tokens it sends to a request's new MoE instance (rows fed KEPT_TOKEN by
        an iteration run before this one)."""
        sent = [self.feed.pick(r, tables, full_tables) for r in range(len(self.instances))]
        inputs = [unpack_rows(r) for r in rows]

        def start(r: int):
            table = RoutingTables.parse(sent[r])
            return self.instances[r].iteration(table, inputs[r], return_logits, handoffs[r] if handoffs else ())

        def restart(r: int, error: StaleBlockTableError):  # refused on its first resume, before any exchange
            if not TableFeed.can_resend_full(sent[r], full_tables):
                raise InstanceFailure(f"decode iteration failed on instance {r}: {error!r}") from error
            sent[r] = full_tables()[r]
            return start(r)

        try:
            outputs = drive_cooperatively([inst.fabric for inst in self.instances], start, restart)
        except InstanceFailure:
            self.feed.forget()
            raise
        for r, table in enumerate(sent):
            self.feed.held_now(r, table)
        return pack_outputs(outputs)


def drive_cooperatively(
    fabrics: list,
    start: Callable[[int], Generator],
    restart: Callable[[int, StaleBlockTableError], Generator] | None = None,
) -> list[RowOutput]:
    """Run one iteration of every instance in this thread: start(r) is instance r's iteration generator, which
    yields a wait (flags on its fabric) at every exchange; whichever instance's wait is satisfied is resumed. A table
    refused on the first resume is handed to restart(r, error) for a new generator (no restart: a failure). Any
    error, and a round in which no instance can move (a deadlock), raises InstanceFailure at once."""
    steps = {r: start(r) for r in range(len(fabrics))}
    waits = {r: None for r in steps}
    outputs: list[RowOutput] = []
    while waits:
        moved = False
        for r in list(waits):
            wait = waits[r]
            if wait is not None and any(fabrics[r].read_flag(f) < v for f, v in wait.flags):
                continue
            try:
                waits[r] = steps[r].send(None)
            except StopIteration as done:
                outputs.extend(done.value)
                del waits[r]
            except StaleBlockTableError as e:
                if restart is None:
                    raise InstanceFailure(f"decode iteration failed on instance {r}: {e!r}") from e
                steps[r] = restart(r, e)
            except Exception as e:
                raise InstanceFailure(f"decode iteration failed on instance {r}: {e!r}") from e
            moved = True
        if not moved:
            raise InstanceFailure(f"decode iteration deadlocked: instances {sorted(waits)} wait forever")
    return outputs


def make_cluster(backend: str, cfg: ClusterConfig, **options):
    """A decode cluster of `cfg.num_instances` instances; `options` go to the Ray cluster (placement)."""
    if torch.device(cfg.device).type != "cpu" and backend not in ("inline", "threads"):
        raise ValueError(f"device {cfg.device!r} runs with the inline or threads backend, not {backend!r}")
    if backend == "inline":
        return InlineCluster(cfg)
    if backend == "threads":
        return ThreadCluster(cfg)
    if backend == "processes":
        from .process_cluster import ProcessCluster

        return ProcessCluster(cfg)
    if backend == "ray":
        from .ray_cluster import RayCluster

        return RayCluster(cfg, **options)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
