"""torch.distributed fabric: ranks on several hosts (gloo on CPU), one-sided puts emulated by messages.

Every rank runs a receiver thread that takes messages from any peer on a private process group and applies
them to its own memory: PUT (rows land straight in the registered buffer), SIGNAL (set a flag, wake waiters)
and STOP (the peer has closed). Messages between one pair of ranks arrive in the order they were sent, so a
signal is applied after every earlier put from the same sender: the put-then-signal guarantee. Puts and
signals to the rank itself are applied directly. The main thread only sends; a send returns once the peer's
receiver thread took the message.

Each message is a fixed int64 header [kind, buffer index, row offset, rows, flag, value, payload bytes] (tag 1),
followed for PUT by the rows as raw bytes (tag 2) received into the destination slice. A put that does not fit
this rank's registration is drained and recorded (later waits raise it), so its sender never blocks.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from nanocp.comm.fabric import DEFAULT_TIMEOUT_S, BufferSpec, Fabric, FabricError, FabricTimeout

_HEADER_TAG, _PAYLOAD_TAG = 1, 2
_PUT, _SIGNAL, _STOP = 1, 2, 3
_HEADER_LEN = 7


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous tensor viewed as uint8 [nbytes] (gloo moves bytes regardless of the dtype)."""
    return t.reshape(-1).view(torch.uint8)


class TorchDistFabric(Fabric):
    """Collective constructor: every rank of the default process group builds one, in the same order."""

    def __init__(
        self,
        num_flags: int = 256,
        idle_timeout_s: float = 7 * 24 * 3600.0,
        close_timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise FabricError("TorchDistFabric needs torch.distributed initialised (init_process_group) first")
        super().__init__(dist.get_rank(), dist.get_world_size(), num_flags)
        # gloo applies the group timeout to the receiver's blocking recv, so it bounds the idle time
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=idle_timeout_s))
        self._close_timeout_s = close_timeout_s
        self._buffers: dict[int, torch.Tensor] = {}
        self._flags = [0] * (num_flags + self.world_size)
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._receiver: threading.Thread | None = None
        if self.world_size > 1:
            self._receiver = threading.Thread(target=self._receive_loop, name=f"fabric-rx{self.rank}", daemon=True)
            self._receiver.start()

    # ---- receiver thread --------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        stopped = 0
        try:
            while stopped < self.world_size - 1:
                src = dist.recv(header, group=self._group, tag=_HEADER_TAG)
                kind, index, offset, nrows, flag, value, nbytes = header.tolist()
                if kind == _PUT:
                    self._receive_rows(src, index, offset, nrows, nbytes)
                elif kind == _SIGNAL and 0 <= flag < len(self._flags):
                    self._set_flag(flag, value)
                elif kind == _STOP:
                    stopped += 1
                else:
                    raise FabricError(f"rank {self.rank}: bad message {header.tolist()} from rank {src}")
        except BaseException as exc:  # noqa: BLE001 - surfaced to every waiter
            with self._cond:
                self._failure = exc
                self._cond.notify_all()

    def _receive_rows(self, src: int, index: int, offset: int, nrows: int, nbytes: int) -> None:
        buf = self._buffers.get(index)
        target = None
        if buf is not None and 0 <= offset and offset + nrows <= buf.shape[0]:
            target = _as_bytes(buf[offset : offset + nrows])
        if target is not None and target.numel() == nbytes:
            dist.recv(target, src=src, group=self._group, tag=_PAYLOAD_TAG)
            return
        dist.recv(torch.empty(nbytes, dtype=torch.uint8), src=src, group=self._group, tag=_PAYLOAD_TAG)
        with self._cond:
            self._failure = self._failure or FabricError(
                f"rank {self.rank}: put of {nbytes} bytes from rank {src} into buffer #{index} rows "
                f"[{offset}, {offset + nrows}) does not match this rank's registration"
            )
            self._cond.notify_all()

    def _set_flag(self, flag: int, value: int) -> None:
        with self._cond:
            self._flags[flag] = value
            self._cond.notify_all()

    # ---- sending ----------------------------------------------------------------------------------------
    def _send(
        self,
        dst: int,
        kind: int,
        index: int = 0,
        offset: int = 0,
        rows: torch.Tensor | None = None,
        flag: int = 0,
        value: int = 0,
    ) -> None:
        nrows = 0 if rows is None else rows.shape[0]
        nbytes = 0 if rows is None else rows.numel() * rows.element_size()
        header = torch.tensor([kind, index, offset, nrows, flag, value, nbytes], dtype=torch.int64)
        with self._send_lock:
            dist.send(header, dst=dst, group=self._group, tag=_HEADER_TAG)
            if rows is not None:
                dist.send(_as_bytes(rows), dst=dst, group=self._group, tag=_PAYLOAD_TAG)

    # ---- hooks ------------------------------------------------------------------------------------------
    def _create_buffer(self, index: int, spec: BufferSpec) -> None:
        self._buffers[index] = torch.zeros(spec.shape, dtype=spec.dtype)

    def _local_buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index]

    def _put(self, dst: int, index: int, spec: BufferSpec, row_offset: int, rows: torch.Tensor) -> None:
        if dst == self.rank:
            self._buffers[index][row_offset : row_offset + rows.shape[0]].copy_(rows)
        else:
            self._send(dst, _PUT, index, row_offset, rows.cpu())

    def _signal(self, dst: int, flag: int, value: int) -> None:
        if dst == self.rank:
            self._set_flag(flag, value)
        else:
            self._send(dst, _SIGNAL, flag=flag, value=value)

    def _wait(self, flag: int, value: int, timeout_s: float) -> int:
        with self._cond:
            self._cond.wait_for(
                lambda: self._flags[flag] >= value or self._failure is not None, timeout=max(timeout_s, 0.0)
            )
            if self._failure is not None:  # a broken delivery poisons every later wait
                raise FabricError(f"rank {self.rank}: delivery failed: {self._failure}") from self._failure
            if self._flags[flag] < value:
                raise FabricTimeout(flag, self.rank, value, self._flags[flag], timeout_s)
            return self._flags[flag]

    def _read_flag(self, flag: int) -> int:
        return self._flags[flag]

    def _close(self) -> None:
        """Collective: tells every peer this rank sends no more, then waits for theirs."""
        if self._receiver is not None:
            for dst in range(self.world_size):
                if dst != self.rank:
                    self._send(dst, _STOP)
            self._receiver.join(self._close_timeout_s)
            if self._receiver.is_alive():
                raise FabricError(f"rank {self.rank}: peers did not close within {self._close_timeout_s}s")
        dist.destroy_process_group(self._group)
        self._buffers.clear()
