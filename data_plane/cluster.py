"""A local decode cluster: N DecodeInstances as threads in this process or as one process each.

The driver (nanocp.LLM, the server) owns the KV pools' memory, so prefill can write a prompt's KV straight into
the pages the scheduler chose, and hands each instance its routing table and the inputs of its MoE rows every
iteration. Instances exchange queries, partial results and MoE tokens over the fabric (in-process or shared
memory). Every fabric wait has a timeout: a dead or stuck instance surfaces as an error, never a hang.

Routing tables carry incremental block tables (control_plane/lowering.py). `run_iteration(tables, rows,
full_tables=plan.full_tables)` sends an instance its incremental table only when its block-table store is known to
hold the table that one builds on; otherwise (a fresh cluster, an instance whose last iteration failed) and when an
instance refuses a table as stale, it sends the full snapshot. Without `full_tables` the tables go out as given.
Each instance's row inputs come as a `RowBatch` (or a dict of RowInputs) and the sampled rows go back as
`SampledRows`: columns, without an object per row on the driver (data_plane/row_messages.py).
"""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import pickle
import select
import time
import traceback
import weakref
from collections.abc import Callable, Generator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection

import numpy as np
import torch

from nanocp.comm.fabric import FabricTimeout, InProcessFabric
from nanocp.comm.metadata_channel import (
    Fault,
    FaultySender,
    MetadataChannelError,
    ShmMetadataReceiver,
    ShmMetadataSender,
)
from nanocp.comm.shm_fabric import ShmFabric
from nanocp.control_plane.lowering import BASE_SEQ_SLOT, FULL_SLOT, RoutingTables
from nanocp.control_plane.scheduler import StalePlanError
from nanocp.driver_policy import own_policy
from nanocp.models import load_config, load_model
from nanocp.startup_heap import freeze_startup_heap

from .block_store import StaleBlockTableError
from .decode_layers import DecodeWeights
from .experts import owned_experts
from .graph_runner import build_graph_engine
from .instance import DecodeInstance, Handoff, InstanceLimits, RowOutput, fabric_flags
from .kv_pool import PagedKVPool
from .row_messages import RowBatch, Rows, SampledRows, pack_outputs, pack_rows, unpack_rows
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
    # Where the instances' weights, KV pools and fabric buffers live. "cuda[:i]": every instance of this process
    # shares that GPU (inline and threads backends; instances in other processes stay on the CPU).
    device: str = "cpu"

    def __post_init__(self) -> None:
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


def _process_main(cfg: ClusterConfig, rank: int, fabric_info, pool_kv: torch.Tensor, taken: torch.Tensor, conn) -> None:
    torch.set_num_threads(1)
    try:
        fabric = ShmFabric(fabric_info, rank)
        instance = build_instance(cfg, rank, fabric, PagedKVPool(pool_kv))
        # The routing table arrives over the metadata channel: the driver pushes it into this context buffer
        # and rings the doorbell; the frame header (sequence, length, checksum) is validated before use.
        tables = ShmMetadataReceiver(rank, cfg.table_capacity_bytes)
        freeze_startup_heap()  # this process only serves iterations (nanocp/startup_heap.py)
        conn.send(("ready", rank, tables.info))
    except Exception:  # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
        return
    taken_now = taken.numpy()  # the shared counter as numpy: a store costs far less than a tensor's
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the driver is gone: nothing left to serve
                break
            if msg[0] == "stop":
                break
            _, seq, packed_rows, return_logits, handoffs = msg
            try:
                table = np.frombuffer(bytearray(tables.wait_table(seq, cfg.metadata_timeout_s)), dtype=np.int32)
                if tables.last_seq != seq:
                    raise MetadataChannelError(f"expected routing table {seq}, got {tables.last_seq}")
            except MetadataChannelError as e:  # lost, torn, corrupt, stale or duplicated push: ask for it again
                conn.send(("resync", seq, f"{type(e).__name__}: {e}"))
                continue
            taken_now[rank] = seq  # the context buffer is free for the next table (the driver may queue one)
            try:
                rows = unpack_rows(packed_rows)
                out = instance.run_iteration(RoutingTables.parse(table), rows, return_logits, handoffs)
                # pickled plainly, like the driver's messages (no reducer table copied per message)
                conn.send_bytes(pickle.dumps(("ok", seq, pack_outputs(out), instance.timing.records)))
                instance.timing.records = []
            except StaleBlockTableError as e:  # refused before any exchange: the driver may send a full snapshot
                conn.send(("stale", seq, f"{type(e).__name__}: {e}"))
            except Exception as e:  # noqa: BLE001 - reported to the driver, the instance keeps serving
                conn.send(("error", seq, f"{type(e).__name__}: {e}", isinstance(e, FabricTimeout)))
    finally:
        gc.unfreeze()  # the startup heap back to the collector: interpreter exit then frees it
        tables.close()
        fabric.close()


@dataclass
class Launch:
    """One iteration sent to every instance of a ProcessCluster, until `collect` has every instance's answer."""

    sent: list[np.ndarray]  # the table each instance got (a stale incremental one is replaced by its snapshot)
    rows: list[RowBatch]
    return_logits: bool
    full_tables: FullTables | None
    handoffs: list[list[Handoff]]  # per instance: kept tokens it sends to a request's new MoE instance
    deadline: float
    retries: list[int]  # resends so far, per instance
    # instance -> ("ok", SampledRows, timing records) | ("error", message, is a fabric timeout)
    answers: dict[int, tuple] = field(default_factory=dict)


class ProcessCluster(_LocalPools):
    """One process per instance (spawned), a shared-memory fabric between them; KV pools in shared memory.

    An iteration is `launch`ed (each instance's table pushed, its inputs sent) and later `collect`ed; up to two may
    be outstanding, so the driver can plan and send iteration t + 1 while the instances run t (overlapped
    iterations, the engine's `overlap` option). An instance's metadata context buffer holds one table: the next
    one is pushed only once the instance has taken the last (`taken`, a shared counter the instance sets after
    copying and validating it) or given it up (a resync answer). Answers carry the push's sequence number, so an
    answer to a resend or to the queued iteration is matched to its launch whatever order it comes in."""

    incremental_tables = True  # run_iteration takes full_tables (see the module docstring)
    overlaps = True  # launch / collect: an iteration can be queued behind the running one
    instances_in_other_processes = True  # the engine's driver thread may run as SCHED_BATCH (nanocp/driver_policy.py)
    max_outstanding = 2

    def __init__(self, cfg: ClusterConfig, start_timeout_s: float = 120.0) -> None:
        self.cfg = cfg
        self.feed = TableFeed(cfg.num_instances)
        self.pools = allocate_pools(cfg, shared=True)
        self._info = ShmFabric.new_session(cfg.num_instances, num_flags=fabric_flags(cfg.num_instances))
        self._taken = torch.zeros(cfg.num_instances, dtype=torch.int64).share_memory_()
        self._taken_now = self._taken.numpy()  # the driver's view (a numpy read costs far less than a tensor's)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        self._lost: set[int] = set()  # instances whose pipe closed: their process is exiting
        with own_policy():  # instances run under the policy of the thread as it was, not the driver's (batch)
            for r in range(cfg.num_instances):
                parent, child = ctx.Pipe()
                args = (cfg, r, self._info, self.pools[r].kv, self._taken, child)
                proc = ctx.Process(target=_process_main, args=args, daemon=True)
                proc.start()
                child.close()  # the process has its own copy: ours would keep the pipe open after it dies (no EOF)
                self._conns.append(parent)
                self._procs.append(proc)
        self._records: list[PhaseRecord] = []
        self.resyncs = 0  # routing tables pushed again after an instance reported a bad or missing one
        self._senders: list[ShmMetadataSender] = []
        self._seqs = [0] * cfg.num_instances  # metadata channel sequence per instance (a resend takes a new one)
        self._given_up = [0] * cfg.num_instances  # last sequence an instance answered "resync" for
        self._waiting: dict[tuple[int, int], Launch] = {}  # (instance, sequence) -> its launch, until answered
        # The pipes of the instances that owe an answer, in one poll object kept from call to call (a fresh wait set
        # per call costs far more than the poll).
        self._poller = select.poll()
        self._polled: set[int] = set()
        self._rank_of_fd = {conn.fileno(): r for r, conn in enumerate(self._conns)}
        self._resends: list[list[Launch]] = [[] for _ in range(cfg.num_instances)]  # due once the buffer is free
        self._outstanding: list[Launch] = []  # launched, not yet collected (oldest first)
        self._faults: dict[int, list[Fault]] = {}  # test hook: faults to inject into the next pushes
        # close() runs it; so does interpreter exit for a cluster never closed (no orphans, no shm left behind)
        self._shutdown = weakref.finalize(self, _stop_processes, self._conns, self._procs, self._senders, self._info)
        for r in range(cfg.num_instances):
            try:
                msg = self._recv(r, start_timeout_s)
            except InstanceFailure as e:
                self.close()
                raise InstanceFailure(
                    f"{e} while starting; its own error is printed above. A script that builds a cluster of "
                    "processes must do so under `if __name__ == '__main__':` (each instance process starts by "
                    "importing the main module)"
                ) from e
            if msg[0] != "ready":
                self.close()
                raise InstanceFailure(f"instance {r} failed to start:\n{msg[1]}")
            self._senders.append(ShmMetadataSender(msg[2]))

    def _recv(self, rank: int, timeout_s: float):
        conn = self._conns[rank]
        if not conn.poll(timeout_s):
            alive = self._procs[rank].is_alive()
            raise InstanceFailure(f"instance {rank} did not answer within {timeout_s:.0f} s (alive={alive})")
        try:
            return conn.recv()
        except (EOFError, ConnectionResetError) as e:  # reset: the process died with our message unread
            self._lost.add(rank)
            raise InstanceFailure(f"instance {rank} died (exit code {self._exit_code(rank)})") from e

    def run_iteration(
        self,
        tables: list[np.ndarray],
        rows: list[Rows],
        return_logits: bool = False,
        full_tables: FullTables | None = None,
    ) -> SampledRows:
        return self.collect(self.launch(tables, rows, return_logits, full_tables))

    def launch(
        self,
        tables: list[np.ndarray],
        rows: list[Rows],
        return_logits: bool = False,
        full_tables: FullTables | None = None,
        handoffs: list[list[Handoff]] | None = None,
    ) -> Launch:
        """Send an iteration to every instance; it runs once they finish the ones launched before it. `handoffs`
        (per instance) hand the tokens an instance kept to the new MoE instance of a request that moved."""
        if len(self._outstanding) >= self.max_outstanding:
            raise RuntimeError(f"at most {self.max_outstanding} iterations can be outstanding; collect one first")
        n = self.cfg.num_instances
        sent = [self.feed.pick(r, tables, full_tables) for r in range(n)]
        deadline = time.monotonic() + self.cfg.timeout_s * 2 + 5
        handoffs = handoffs or [[] for _ in range(n)]
        launch = Launch(sent, [pack_rows(r) for r in rows], return_logits, full_tables, handoffs, deadline, [0] * n)
        self._outstanding.append(launch)
        for r in range(n):
            self._wait_until_free(r, deadline)
            self._push(launch, r)
        for r, table in enumerate(sent):  # the stores will hold these once they run (a failure forgets it)
            self.feed.held_now(r, table)
        return launch

    def collect(self, launch: Launch) -> SampledRows:
        """Wait for every instance's answer to `launch` (the oldest outstanding iteration): its sampled rows, or
        InstanceFailure naming the first real error."""
        if not self._outstanding or self._outstanding[0] is not launch:
            raise RuntimeError("collect the oldest outstanding iteration first")
        n = self.cfg.num_instances
        while len(launch.answers) < n:
            if not self._take_answers(launch.deadline - time.monotonic()):
                for r in range(n):
                    launch.answers.setdefault(r, ("error", f"instance {r} did not answer in time", False))
        self._outstanding.pop(0)
        errors = [a for a in launch.answers.values() if a[0] != "ok"]
        if errors:
            self.feed.forget()
            real = [text for _, text, is_timeout in errors if not is_timeout] or [errors[0][1]]
            raise InstanceFailure(f"decode iteration failed: {real[0]}")
        for r in range(n):
            self._records.extend(launch.answers[r][2])
        return SampledRows.concat([launch.answers[r][1] for r in range(n)])

    def _is_free(self, r: int) -> bool:
        """Instance r's context buffer may take a new table: it took or gave up the last one pushed."""
        return max(int(self._taken_now[r]), self._given_up[r]) >= self._seqs[r]

    def _wait_until_free(self, r: int, deadline: float) -> None:
        """Until instance r has taken its last table (usually it has: it started long ago), take every instance's
        answers: r may be waiting on the fabric for a peer whose resend is due."""
        while not self._is_free(r) and r not in self._lost:
            if time.monotonic() > deadline:
                raise InstanceFailure(f"instance {r} did not take its routing table in time")
            self._take_answers(1e-4)

    def _push(self, launch: Launch, r: int) -> None:
        """Push instance r's table of `launch` (new sequence number) and tell it to run the iteration."""
        if r in self._lost:
            launch.answers[r] = ("error", f"instance {r} died (exit code {self._exit_code(r)})", False)
            return
        self._seqs[r] += 1
        seq = self._seqs[r]
        faults = self._faults.get(r)
        if faults:
            FaultySender(self._senders[r]).push(seq, launch.sent[r].tobytes(), fault=faults.pop(0))
        else:
            self._senders[r].push(seq, launch.sent[r].tobytes())
        self._waiting[(r, seq)] = launch
        try:
            # Pickled plainly: nothing in it needs multiprocessing's reducers, whose table `send` copies per message.
            message = ("run", seq, launch.rows[r], launch.return_logits, launch.handoffs[r])
            self._conns[r].send_bytes(pickle.dumps(message))
        except OSError:  # broken pipe: the process is gone
            self._lost_instance(r)

    def _take_answers(self, timeout_s: float) -> bool:
        """Take the answers that arrive within timeout_s from every instance that owes one, then push the resends
        whose instance's buffer is free. False when nothing came."""
        ready = self._poll_owing(timeout_s)
        for r in ready:
            self._take_answer(r)
        for r in range(self.cfg.num_instances):
            while self._resends[r] and self._is_free(r):
                self._push(self._resends[r].pop(0), r)
        return bool(ready)

    def _poll_owing(self, timeout_s: float) -> list[int]:
        """The instances that owe an answer and have one (or an EOF) to read within timeout_s, in rank order."""
        owing = {r for r, _ in self._waiting}
        for r in owing - self._polled:
            self._poller.register(self._conns[r].fileno(), select.POLLIN)
        for r in self._polled - owing:
            self._poller.unregister(self._conns[r].fileno())
        self._polled = owing
        if not owing:
            return []
        events = self._poller.poll(math.ceil(max(0.0, timeout_s) * 1e3))
        return sorted(self._rank_of_fd[fd] for fd, _ in events)

    def _take_answer(self, r: int) -> None:
        """Read one answer of instance r and file it with its launch (a table to resend is queued)."""
        try:
            msg = self._conns[r].recv()
        except (EOFError, ConnectionResetError):  # reset: the process died with our message unread
            self._lost_instance(r)
            return
        kind, seq = msg[0], msg[1]
        launch = self._waiting.pop((r, seq))
        if kind == "resync":
            self._given_up[r] = max(self._given_up[r], seq)
        if kind == "stale" and TableFeed.can_resend_full(launch.sent[r], launch.full_tables):
            try:  # its store missed a table: rebuild it from the full snapshot
                launch.sent[r] = launch.full_tables()[r]
                kind = "resync"
            except StalePlanError:  # an overlapped launch whose plan is no longer the scheduler's latest
                pass
        if kind == "resync" and launch.retries[r] < self.cfg.metadata_retries:
            launch.retries[r] += 1
            self.resyncs += 1
            self._resends[r].append(launch)
        elif kind == "ok":
            launch.answers[r] = ("ok", msg[2], msg[3])
        elif kind == "resync":
            launch.answers[r] = ("error", f"instance {r}: routing table undeliverable ({msg[2]})", False)
        elif kind == "stale":
            launch.answers[r] = ("error", f"instance {r}: {msg[2]}", False)
        else:
            launch.answers[r] = ("error", f"instance {r}: {msg[2]}", msg[3])

    def _lost_instance(self, r: int) -> None:
        """Instance r's pipe closed: every launch waiting on it gets its error."""
        self._lost.add(r)
        error = ("error", f"instance {r} died (exit code {self._exit_code(r)})", False)
        for key in [k for k in self._waiting if k[0] == r]:
            self._waiting.pop(key).answers[r] = error
        for launch in self._resends[r]:
            launch.answers[r] = error
        self._resends[r].clear()

    def _exit_code(self, r: int) -> int | None:
        """Instance r's exit code, once it has exited: its pipe closes a moment before (up to 5 s of waiting)."""
        proc = self._procs[r]
        mp_connection.wait([proc.sentinel], timeout=5.0)
        return proc.exitcode

    def dead_instances(self) -> list[int]:
        # A closed pipe can be seen a moment before the process has exited: give those time to end. A process has
        # exited once its sentinel is readable, whichever thread reaps it (is_alive() says True while another
        # thread's join is reaping it: its waitpid fails).
        for r in self._lost:
            mp_connection.wait([self._procs[r].sentinel], timeout=5.0)
        return [r for r, proc in enumerate(self._procs) if mp_connection.wait([proc.sentinel], timeout=0)]

    def kill_instance(self, instance: int) -> None:
        """Fault injection (tests, reliability runs): SIGKILL one instance process."""
        self._procs[instance].kill()
        self._procs[instance].join()

    def inject_metadata_fault(self, instance: int, fault: Fault) -> None:
        """Fault injection (tests): the next routing-table push to `instance` is dropped/corrupted/torn."""
        self._faults.setdefault(instance, []).append(fault)

    def timing_records(self) -> list[PhaseRecord]:
        records, self._records = self._records, []
        return records

    def close(self) -> None:
        self._shutdown()


def _stop_processes(conns: list, procs: list, senders: list, info) -> None:
    """Stop the instance processes (a "stop" message, then SIGKILL after 10 s) and free the shared memory. A
    ProcessCluster's finalizer: it runs on close(), or at interpreter exit for a cluster nobody closed."""
    for conn, proc in zip(conns, procs):
        try:
            if proc.is_alive():
                conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for sender in senders:
        sender.close()
    ShmFabric.cleanup(info)


def make_cluster(backend: str, cfg: ClusterConfig, **options):
    """A decode cluster of `cfg.num_instances` instances; `options` go to the Ray cluster (placement)."""
    if torch.device(cfg.device).type != "cpu" and backend not in ("inline", "threads"):
        raise ValueError(f"device {cfg.device!r} runs with the inline or threads backend, not {backend!r}")
    if backend == "inline":
        return InlineCluster(cfg)
    if backend == "threads":
        return ThreadCluster(cfg)
    if backend == "processes":
        return ProcessCluster(cfg)
    if backend == "ray":
        from .ray_cluster import RayCluster

        return RayCluster(cfg, **options)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
