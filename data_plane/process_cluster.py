"""A local decode cluster of one spawned process per instance, a shared-memory fabric between them.

Routing tables travel over the shm metadata channel, row inputs and sampled rows over one pipe per instance
(data_plane/row_messages.py). The driver watches every instance: its pipe, its process's sentinel (exit) and its
heartbeat (comm/liveness.py: a thread of the instance process bumps a shared counter; a stopped or wedged process
stops). As soon as one is lost (died, stopped answering, or failed its iteration) the driver raises the shared abort
word to a new epoch: the survivors' fabric waits for iterations launched before it raise `FabricAborted` within one
poll, they answer those iterations as aborted, and the failure reaches the engine in milliseconds instead of a fabric
timeout (each "run" message carries the epoch it was launched in; later ones run normally). A hung instance is
SIGKILLed before anything it held is reused. `rebuild` then builds the smaller cluster inside the surviving processes
(new ranks, the experts re-sharded, a new fabric), which costs a fraction of spawning new ones.
"""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import pickle
import select
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection

import numpy as np
import torch

from nanocp.comm.fabric import FabricAborted, FabricTimeout
from nanocp.comm.liveness import Heartbeat, HeartbeatMonitor, LivenessBoard, LivenessInfo, heartbeat_period
from nanocp.comm.metadata_channel import (
    Fault,
    FaultySender,
    MetadataChannelError,
    ShmMetadataReceiver,
    ShmMetadataSender,
)
from nanocp.comm.shm_fabric import ShmFabric, ShmFabricInfo
from nanocp.control_plane.lowering import RoutingTables
from nanocp.control_plane.scheduler import StalePlanError
from nanocp.driver_policy import own_policy
from nanocp.startup_heap import freeze_startup_heap

from .block_store import StaleBlockTableError
from .cluster import ClusterConfig, FullTables, InstanceFailure, TableFeed, _LocalPools, allocate_pools, build_instance
from .instance import Handoff, fabric_flags
from .kv_pool import PagedKVPool
from .row_messages import RowBatch, Rows, SampledRows, pack_outputs, pack_rows, unpack_rows
from .timing import PhaseRecord


class _InstanceProcess:
    """The body of one instance process: builds its instance, serves iterations, rebuilds it on request. `slot`
    names the process in the shared counters (table taken, heartbeat) and stays when the cluster is rebuilt."""

    def __init__(self, cfg: ClusterConfig, slot: int, pool_kv: torch.Tensor, taken: torch.Tensor, liveness, conn):
        self.cfg, self.slot, self.conn = cfg, slot, conn
        self.board = LivenessBoard.attach(liveness)
        self.heart = Heartbeat(self.board, slot, heartbeat_period(cfg.heartbeat_timeout_s))
        self.pool = PagedKVPool(pool_kv)
        self.taken_now = taken.numpy()  # the shared counter as numpy: a store costs far less than a tensor's
        self.fabric = self.instance = self.tables = None

    def build(self, cfg: ClusterConfig, rank: int, fabric_info: ShmFabricInfo, epoch: int) -> None:
        self.cfg = cfg
        self.fabric = ShmFabric(fabric_info, rank, abort=self.board.abort_word(epoch + 1))
        self.instance = build_instance(cfg, rank, self.fabric, self.pool)

    def start(self, fabric_info: ShmFabricInfo) -> bool:
        """Build the first instance (rank = slot, epoch 0) and report ready."""
        try:
            self.build(self.cfg, self.slot, fabric_info, 0)
            # The routing table arrives over the metadata channel: the driver pushes it into this context buffer
            # and rings the doorbell; the frame header (sequence, length, checksum) is validated before use.
            self.tables = ShmMetadataReceiver(self.slot, self.cfg.table_capacity_bytes)
            freeze_startup_heap()  # this process only serves iterations (nanocp/startup_heap.py)
        except Exception:  # noqa: BLE001 - reported to the driver
            self.conn.send(("error", traceback.format_exc()))
            return False
        self.conn.send(("ready", self.slot, self.tables.info))
        return True

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except EOFError:  # the driver is gone: nothing left to serve
                return
            if msg[0] == "stop":
                return
            if msg[0] == "rebuild":
                if not self.rebuild(*msg[1:]):
                    return
                continue
            self.run(*msg[1:])

    def rebuild(self, cfg: ClusterConfig, rank: int, fabric_info: ShmFabricInfo, epoch: int) -> bool:
        """A new instance of rank `rank` in a cluster of cfg.num_instances (its experts, a new fabric); the KV pool
        and the metadata channel stay."""
        gc.unfreeze()
        self.drop_instance()
        try:
            self.build(cfg, rank, fabric_info, epoch)
        except Exception:  # noqa: BLE001 - reported to the driver
            self.conn.send(("error", traceback.format_exc()))
            return False
        freeze_startup_heap()
        self.conn.send(("ready", rank, None))
        return True

    def run(self, seq: int, packed_rows: RowBatch, return_logits: bool, handoffs: list[Handoff], epoch: int) -> None:
        conn, tables = self.conn, self.tables
        self.fabric.abort.generation = epoch + 1  # aborted once the driver raises the word past its launch epoch
        try:
            table = np.frombuffer(bytearray(tables.wait_table(seq, self.cfg.metadata_timeout_s)), dtype=np.int32)
            if tables.last_seq != seq:
                raise MetadataChannelError(f"expected routing table {seq}, got {tables.last_seq}")
        except MetadataChannelError as e:  # lost, torn, corrupt, stale or duplicated push: ask for it again
            conn.send(("resync", seq, f"{type(e).__name__}: {e}"))
            return
        self.taken_now[self.slot] = seq  # the context buffer is free for the next table (the driver may queue one)
        instance = self.instance
        try:
            rows = unpack_rows(packed_rows)
            out = instance.run_iteration(RoutingTables.parse(table), rows, return_logits, handoffs)
            # pickled plainly, like the driver's messages (no reducer table copied per message)
            conn.send_bytes(pickle.dumps(("ok", seq, pack_outputs(out), instance.timing.records)))
            instance.timing.records = []
        except StaleBlockTableError as e:  # refused before any exchange: the driver may send a full snapshot
            conn.send(("stale", seq, f"{type(e).__name__}: {e}"))
        except FabricAborted as e:  # the driver lost a peer: a consequence, not a cause
            conn.send(("error", seq, f"{type(e).__name__}: {e}", True))
        except Exception as e:  # noqa: BLE001 - reported to the driver, the instance keeps serving
            conn.send(("error", seq, f"{type(e).__name__}: {e}", isinstance(e, FabricTimeout)))

    def drop_instance(self) -> None:
        self.instance = None
        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None

    def close(self) -> None:
        gc.unfreeze()  # the startup heap back to the collector: interpreter exit then frees it
        if self.tables is not None:
            self.tables.close()
        self.drop_instance()
        self.heart.stop()
        self.board.close()


def _process_main(
    cfg: ClusterConfig,
    slot: int,
    fabric_info: ShmFabricInfo,
    pool_kv: torch.Tensor,
    taken: torch.Tensor,
    liveness: LivenessInfo,
    conn,
) -> None:
    torch.set_num_threads(1)
    try:
        body = _InstanceProcess(cfg, slot, pool_kv, taken, liveness, conn)
    except Exception:  # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
        return
    try:
        if body.start(fabric_info):
            body.serve()
    finally:
        body.close()


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
    epoch: int  # the abort epoch it was launched in: aborted once the driver's epoch is past it
    # instance -> ("ok", SampledRows, timing records) | ("error", message, is a consequence of another failure)
    answers: dict[int, tuple] = field(default_factory=dict)


@dataclass
class _Shared:
    """What the processes of a cluster share with the driver across rebuilds (indexed by slot)."""

    board: LivenessBoard
    taken: torch.Tensor  # int64 [slots]: the last table each process took


class ProcessCluster(_LocalPools):
    """One process per instance (spawned), a shared-memory fabric between them; KV pools in shared memory.

    An iteration is `launch`ed (each instance's table pushed, its inputs sent) and later `collect`ed; up to two may
    be outstanding, so the driver can plan and send iteration t + 1 while the instances run t (overlapped
    iterations, the engine's `overlap` option). An instance's metadata context buffer holds one table: the next
    one is pushed only once the instance has taken the last (`taken`, a shared counter the instance sets after
    copying and validating it) or given it up (a resync answer). Answers carry the push's sequence number, so an
    answer to a resend or to the queued iteration is matched to its launch whatever order it comes in.

    Failures (module docstring): a lost instance aborts every outstanding iteration at once; `dead_instances`
    settles them (every survivor has answered) and `rebuild` reuses the survivors' processes."""

    incremental_tables = True  # run_iteration takes full_tables (see data_plane/cluster.py)
    overlaps = True  # launch / collect: an iteration can be queued behind the running one
    instances_in_other_processes = True  # the engine's driver thread may run as SCHED_BATCH (nanocp/driver_policy.py)
    max_outstanding = 2

    def __init__(self, cfg: ClusterConfig, start_timeout_s: float = 120.0) -> None:
        self._init_state(cfg, slots=list(range(cfg.num_instances)))
        self.pools = allocate_pools(cfg, shared=True)
        board = LivenessBoard.create(cfg.num_instances)
        self._shared = _Shared(board, torch.zeros(cfg.num_instances, dtype=torch.int64).share_memory_())
        ctx = mp.get_context("spawn")
        try:
            with own_policy():  # instances run under the policy of the thread as it was, not the driver's (batch)
                for r in range(cfg.num_instances):
                    parent, child = ctx.Pipe()
                    args = (cfg, r, self._info, self.pools[r].kv, self._shared.taken, board.info, child)
                    proc = ctx.Process(target=_process_main, args=args, daemon=True)
                    proc.start()
                    child.close()  # the process has its own copy: ours would keep the pipe open after it dies
                    self._conns.append(parent)
                    self._procs.append(proc)
        except BaseException:  # e.g. spawned from a process still bootstrapping: nothing may be left behind
            for proc in self._procs:
                proc.kill()
            board.close()
            raise
        self._finish_init()
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
        self._watch()

    def _init_state(self, cfg: ClusterConfig, slots: list[int]) -> None:
        n = cfg.num_instances
        self.cfg = cfg
        self.feed = TableFeed(n)
        self._slots = slots  # rank -> the process's slot in the shared counters
        self._info = ShmFabric.new_session(n, num_flags=fabric_flags(n))
        self._conns, self._procs = [], []
        self._senders: list[ShmMetadataSender] = []
        self._lost: set[int] = set()  # instances whose process is gone (or was killed: it stopped answering)
        self._records: list[PhaseRecord] = []
        self.resyncs = 0  # routing tables pushed again after an instance reported a bad or missing one
        self._seqs = [0] * n  # metadata channel sequence per instance (a resend takes a new one)
        self._given_up = [0] * n  # last sequence an instance answered "resync" for
        self._waiting: dict[tuple[int, int], Launch] = {}  # (instance, sequence) -> its launch, until answered
        self._resends: list[list[Launch]] = [[] for _ in range(n)]  # due once the buffer is free
        self._outstanding: list[Launch] = []  # launched, not yet collected (oldest first)
        self._faults: dict[int, list[Fault]] = {}  # test hook: faults to inject into the next pushes
        self.failure: str | None = None  # why iterations were last aborted
        self.hung: list[int] = []  # instances killed because they stopped answering

    def _finish_init(self) -> None:
        """The poll set and the finalizer, once the processes and pipes exist."""
        self._taken_now = self._shared.taken.numpy()  # the driver's view (a numpy read costs far less)
        # The pipes of the instances that owe an answer and every live process's sentinel, in one poll object kept
        # from call to call (a fresh wait set per call costs far more than the poll).
        self._poller = select.poll()
        self._polled: set[int] = set()
        self._rank_of_fd = {conn.fileno(): r for r, conn in enumerate(self._conns)}
        self._rank_of_sentinel = {proc.sentinel: r for r, proc in enumerate(self._procs)}
        for fd in self._rank_of_sentinel:
            self._poller.register(fd, select.POLLIN)
        self._monitor = HeartbeatMonitor(self._shared.board, self.cfg.heartbeat_timeout_s)
        self._look_every_s = heartbeat_period(self.cfg.heartbeat_timeout_s)
        # close() runs it; so does interpreter exit for a cluster never closed (no orphans, no shm left behind)
        self._shutdown = weakref.finalize(
            self, _stop_processes, self._conns, self._procs, self._senders, self._info, self._shared.board
        )

    def _watch(self) -> None:
        self._monitor.watch(self._slots[r] for r in range(self.cfg.num_instances) if r not in self._lost)

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

    # ---- iterations ---------------------------------------------------------------------------------------

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
        packed = [pack_rows(r) for r in rows]
        launch = Launch(sent, packed, return_logits, full_tables, handoffs, deadline, [0] * n, self._epoch)
        self._outstanding.append(launch)
        for r in range(n):
            self._wait_until_free(r, launch)
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
            if not self._take_answers(launch.deadline - time.monotonic()) and time.monotonic() > launch.deadline:
                for r in range(n):
                    launch.answers.setdefault(r, ("error", f"instance {r} did not answer in time", False))
                self._abort(f"iteration deadline passed ({self.cfg.timeout_s * 2 + 5:.0f} s)")
        self._outstanding.pop(0)
        errors = [a for a in launch.answers.values() if a[0] != "ok"]
        if errors:
            self.feed.forget()
            real = [text for _, text, consequence in errors if not consequence] or [errors[0][1]]
            raise InstanceFailure(f"decode iteration failed: {real[0]}")
        for r in range(n):
            self._records.extend(launch.answers[r][2])
        return SampledRows.concat([launch.answers[r][1] for r in range(n)])

    def _is_free(self, r: int) -> bool:
        """Instance r's context buffer may take a new table: it took or gave up the last one pushed."""
        return max(int(self._taken_now[self._slots[r]]), self._given_up[r]) >= self._seqs[r]

    def _wait_until_free(self, r: int, launch: Launch) -> None:
        """Until instance r has taken its last table (usually it has: it started long ago), take every instance's
        answers: r may be waiting on the fabric for a peer whose resend is due."""
        while not self._is_free(r) and r not in self._lost and not self._aborted(launch):
            if time.monotonic() > launch.deadline:
                raise InstanceFailure(f"instance {r} did not take its routing table in time")
            self._take_answers(1e-4)

    def _push(self, launch: Launch, r: int) -> None:
        """Push instance r's table of `launch` (new sequence number) and tell it to run the iteration."""
        if r in self._lost:
            launch.answers[r] = ("error", self._lost_message(r), False)
            return
        if self._aborted(launch):  # it would fail at its first wait
            launch.answers[r] = ("error", f"instance {r}: aborted ({self.failure})", True)
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
            message = ("run", seq, launch.rows[r], launch.return_logits, launch.handoffs[r], launch.epoch)
            self._conns[r].send_bytes(pickle.dumps(message))
        except OSError:  # broken pipe: the process is gone
            self._lost_instance(r)

    def _take_answers(self, timeout_s: float) -> bool:
        """Take the answers that arrive within timeout_s from every instance that owes one, then push the resends
        whose instance's buffer is free. Looks at the instances' liveness at least every heartbeat period. False
        when no answer came."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            answered, exited = self._poll(min(self._look_every_s, deadline - time.monotonic()))
            for r in exited:
                self._lost_instance(r)
            for r in answered:
                if r not in self._lost:
                    self._take_answer(r)
            self._look_for_hangs()
            for r in range(self.cfg.num_instances):
                while self._resends[r] and self._is_free(r):
                    self._push(self._resends[r].pop(0), r)
            if answered or exited or time.monotonic() >= deadline:
                return bool(answered)

    def _poll(self, timeout_s: float) -> tuple[list[int], list[int]]:
        """(instances that owe an answer and have one, or an EOF, to read; instances whose process exited) within
        timeout_s, in rank order."""
        owing = {r for r, _ in self._waiting}
        for r in owing - self._polled:
            self._poller.register(self._conns[r].fileno(), select.POLLIN)
        for r in self._polled - owing:
            self._poller.unregister(self._conns[r].fileno())
        self._polled = owing
        answered, exited = [], []
        for fd, _ in self._poller.poll(math.ceil(max(0.0, timeout_s) * 1e3)):
            if fd in self._rank_of_fd:
                answered.append(self._rank_of_fd[fd])
            else:
                exited.append(self._rank_of_sentinel[fd])
        return sorted(answered), sorted(exited)

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
        if kind == "resync" and launch.retries[r] < self.cfg.metadata_retries and not self._aborted(launch):
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
        if launch.answers.get(r, ("ok",))[0] != "ok":
            self._abort(launch.answers[r][1])  # its peers may wait on the fabric for it: release them now

    # ---- failures -------------------------------------------------------------------------------------------

    @property
    def _epoch(self) -> int:
        return self._shared.board.epoch

    def _aborted(self, launch: Launch) -> bool:
        return launch.epoch < self._epoch

    def _abort(self, why: str) -> None:
        """Abort every outstanding iteration: the instances' fabric waits for them raise FabricAborted at once, and
        nothing more of them is pushed (later launches run normally)."""
        if not any(launch.epoch == self._epoch for launch in self._outstanding):
            return  # nothing of this epoch is running
        self.failure = why
        self._shared.board.abort(self._epoch + 1)
        for r in range(self.cfg.num_instances):  # resends would only be aborted too
            for launch in self._resends[r]:
                launch.answers.setdefault(r, ("error", f"instance {r}: aborted ({why})", True))
            self._resends[r].clear()

    def _look_for_hangs(self) -> None:
        """Kill every instance whose heartbeat stopped for heartbeat_timeout_s (SIGKILL works on a stopped process
        too): it is dead before anything it held is reused."""
        for slot in self._monitor.silent():
            r = self._slots.index(slot)
            self._monitor.unwatch(slot)
            self.hung.append(r)
            self._procs[r].kill()
            self._lost_instance(r)

    def _lost_instance(self, r: int) -> None:
        """Instance r's process is gone (or was killed): every launch waiting on it gets its error and the
        outstanding iterations are aborted."""
        if r not in self._lost:
            self._lost.add(r)
            self._monitor.unwatch(self._slots[r])
            sentinel = self._procs[r].sentinel
            if sentinel in self._rank_of_sentinel:
                self._poller.unregister(sentinel)
                del self._rank_of_sentinel[sentinel]
        error = ("error", self._lost_message(r), False)
        for key in [k for k in self._waiting if k[0] == r]:
            self._waiting.pop(key).answers[r] = error
        for launch in self._resends[r]:
            launch.answers[r] = error
        self._resends[r].clear()
        for launch in self._outstanding:  # launches not pushed to r yet (they never will be)
            launch.answers.setdefault(r, error)
        self._abort(error[1])

    def _lost_message(self, r: int) -> str:
        if r in self.hung:
            return f"instance {r} stopped answering (no heartbeat for {self.cfg.heartbeat_timeout_s:g} s): killed"
        return f"instance {r} died (exit code {self._exit_code(r)})"

    def _exit_code(self, r: int) -> int | None:
        """Instance r's exit code, once it has exited (up to 5 s of waiting): its pipe, and even its sentinel, close
        a moment before the process can be reaped."""
        proc, deadline = self._procs[r], time.monotonic() + 5.0
        mp_connection.wait([proc.sentinel], timeout=5.0)
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return proc.exitcode

    def settle(self, timeout_s: float | None = None) -> None:
        """After a failure: abort what is outstanding and take every live instance's answer to it (an instance
        that does not answer in time is killed), so the survivors are idle. Outstanding launches are dropped."""
        self._abort(self.failure or "settling after a failure")
        timeout_s = self.cfg.heartbeat_timeout_s + 5 if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while any(r not in self._lost for r, _ in self._waiting):
            if time.monotonic() > deadline:
                for r in sorted({r for r, _ in self._waiting} - self._lost):
                    self.hung.append(r)
                    self._procs[r].kill()
                    self._lost_instance(r)
                break
            self._take_answers(deadline - time.monotonic())
        self._outstanding.clear()
        self._waiting.clear()

    def dead_instances(self) -> list[int]:
        self.settle()
        # A closed pipe can be seen a moment before the process has exited: give those time to end. A process has
        # exited once its sentinel is readable, whichever thread reaps it (is_alive() says True while another
        # thread's join is reaping it: its waitpid fails).
        for r in self._lost:
            mp_connection.wait([self._procs[r].sentinel], timeout=5.0)
        return [r for r, proc in enumerate(self._procs) if mp_connection.wait([proc.sentinel], timeout=0)]

    def rebuild(self, cfg: ClusterConfig, start_timeout_s: float = 120.0) -> ProcessCluster:
        """The cluster of `cfg` built inside this one's surviving processes (new ranks in slot order, the experts
        re-sharded, a new fabric), which then replaces this one; cfg.num_instances must be the survivors' count.
        Each survivor keeps its KV pool (same frames) and metadata channel. Falls back to new processes when the
        survivors cannot be reused."""
        dead = set(self.dead_instances())
        survivors = [r for r in range(self.cfg.num_instances) if r not in dead]
        if len(survivors) != cfg.num_instances or _process_shape(cfg) != _process_shape(self.cfg):
            self.close()
            return ProcessCluster(cfg, start_timeout_s)
        new = ProcessCluster.__new__(ProcessCluster)
        new._init_state(cfg, [self._slots[r] for r in survivors])
        new._shared = self._shared
        new.pools = [self.pools[r] for r in survivors]
        new._conns = [self._conns[r] for r in survivors]
        new._procs = [self._procs[r] for r in survivors]
        new._seqs = [self._seqs[r] for r in survivors]
        new._given_up = [self._given_up[r] for r in survivors]
        new._senders = [self._senders[r] for r in survivors]
        self._shutdown.detach()  # the survivors now belong to `new`; the rest is released here
        for r in sorted(dead):
            self._senders[r].close()
            self._conns[r].close()
            self._procs[r].join(timeout=5)
        new._finish_init()
        try:
            for rank, conn in enumerate(new._conns):
                conn.send(("rebuild", cfg, rank, new._info, new._epoch))
            for rank in range(cfg.num_instances):
                msg = new._recv(rank, start_timeout_s)
                if msg[0] != "ready":
                    raise InstanceFailure(f"instance {rank} failed to rebuild:\n{msg[1]}")
        except (InstanceFailure, OSError):
            new.close()
            ShmFabric.cleanup(self._info)
            return ProcessCluster(cfg, start_timeout_s)
        ShmFabric.cleanup(self._info)  # what the dead ranks of the old fabric left
        new._watch()
        return new

    def kill_instance(self, instance: int) -> None:
        """Fault injection (tests, reliability runs): SIGKILL one instance process."""
        self._procs[instance].kill()
        self._procs[instance].join()

    def stop_instance(self, instance: int) -> None:
        """Fault injection (tests, reliability runs): SIGSTOP one instance process (it hangs without dying)."""
        os.kill(self._procs[instance].pid, signal.SIGSTOP)

    def instance_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def inject_metadata_fault(self, instance: int, fault: Fault) -> None:
        """Fault injection (tests): the next routing-table push to `instance` is dropped/corrupted/torn."""
        self._faults.setdefault(instance, []).append(fault)

    def timing_records(self) -> list[PhaseRecord]:
        records, self._records = self._records, []
        return records

    def close(self) -> None:
        self._shutdown()


def _process_shape(cfg: ClusterConfig) -> tuple:
    """What a process keeps across a rebuild: its KV pool, its metadata channel, its heartbeat period."""
    return (
        cfg.model,
        cfg.frames_per_instance,
        cfg.page_size,
        cfg.dtype,
        cfg.use_graphs,
        cfg.device,
        cfg.table_capacity_bytes,
        cfg.heartbeat_timeout_s,
    )


def _stop_processes(conns: list, procs: list, senders: list, info: ShmFabricInfo, board: LivenessBoard) -> None:
    """Stop the instance processes (a "stop" message, then SIGKILL after 10 s) and free the shared memory. A
    ProcessCluster's finalizer: it runs on close(), or at interpreter exit for a cluster nobody closed."""
    board.abort(2**62)  # an instance still waiting on the fabric returns at once and reads its "stop"
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
    board.close()
