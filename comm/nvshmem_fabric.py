"""NVSHMEM fabric (nvshmem4py): symmetric GPU buffers, one-sided puts with signal, waits on the signal.

Every rank is one GPU process. Buffers and flags are allocated collectively on the NVSHMEM symmetric heap, so the
same local address names a peer's copy. A put is a stream-ordered `nvshmemx_putmem_on_stream` into the peer's
rows; the last put to a peer before a `signal` goes out as `putmem_signal` (the flag is set once that data has
landed) after a `quiet` that completes the earlier puts; a signal without data is `quiet` + `signal_op`.
The receiver waits on its flag from the host (`wait`, with a timeout, polling the flag) or on the GPU stream
(`wait_on_stream`, `signal_wait_until`: what a captured CUDA graph uses). Puts become visible with the next signal
to that peer, as the Fabric contract says.

Raw-address bindings (`nvshmem.bindings.*_on_stream`) are used because nvshmem4py's tensor helpers only resolve
whole allocations, not row ranges. Set up with `init_nvshmem(group)` once per process (unique id broadcast over
torch.distributed), then build `NvshmemFabric(rank, world_size, num_flags)` on every rank in the same order.
"""

from __future__ import annotations

import time

import torch

from .fabric import BufferSpec, Fabric, FabricTimeout, poll_until


def nvshmem_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "NVSHMEM needs CUDA GPUs"
    try:
        import nvshmem.core  # noqa: F401
    except ImportError as e:
        return f"nvshmem4py does not import ({e}); pip install nvshmem4py-cu12 (docs/gpu.md)"
    return None


def init_nvshmem(group=None) -> None:
    """Initialise NVSHMEM on this process's current CUDA device: rank 0's unique id, broadcast over
    torch.distributed (`group`, default world), initializer_method="uid"."""
    reason = nvshmem_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import nvshmem.core
    import torch.distributed as dist
    from cuda.core.experimental import Device

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    uid = nvshmem.core.get_unique_id(empty=rank != 0)
    box = [uid if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    device = Device(torch.cuda.current_device())
    device.set_current()
    nvshmem.core.init(device=device, uid=box[0], rank=rank, nranks=world, initializer_method="uid")


class NvshmemFabric(Fabric):
    """comm.fabric.Fabric on NVSHMEM. Tensors put must live on this rank's GPU (CPU tensors are copied there)."""

    def __init__(self, rank: int, world_size: int, num_flags: int, stream: torch.cuda.Stream | None = None):
        reason = nvshmem_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        import nvshmem.bindings
        import nvshmem.core

        super().__init__(rank, world_size, num_flags)
        if nvshmem.core.my_pe() != rank or nvshmem.core.n_pes() != world_size:
            raise ValueError(
                f"NVSHMEM says PE {nvshmem.core.my_pe()} of {nvshmem.core.n_pes()}, the fabric was built as rank "
                f"{rank} of {world_size}: initialise NVSHMEM with the same ranks (init_nvshmem)"
            )
        self._core, self._bind = nvshmem.core, nvshmem.bindings
        self._signal_set = int(nvshmem.core.SignalOp.SIGNAL_SET)
        self._cmp_ge = int(nvshmem.core.ComparisonType.CMP_GE)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = stream or torch.cuda.current_stream(self.device)
        self._buffers: dict[int, torch.Tensor] = {}
        self._flags = nvshmem.core.tensor((num_flags + world_size,), dtype=torch.int64)  # symmetric, collective
        self._flags.zero_()
        self._pending: dict[int, tuple[int, int, int, torch.Tensor]] = {}  # dst -> the put held back for signal
        self._unquieted = False  # puts issued since the last quiet
        self._poll_stream = torch.cuda.Stream(self.device)  # host polls of flags never queue behind our work
        torch.cuda.synchronize(self.device)

    @property
    def _stream_ptr(self) -> int:
        return int(self.stream.cuda_stream)

    def _flag_ptr(self, flag: int) -> int:
        return self._flags.data_ptr() + flag * self._flags.element_size()

    # ---- Fabric hooks -------------------------------------------------------------------------------------
    def _create_buffer(self, index: int, spec: BufferSpec) -> None:
        buf = self._core.tensor(spec.shape, dtype=spec.dtype)  # collective: every rank allocates in order
        buf.zero_()
        self._buffers[index] = buf

    def _local_buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index]

    def _put(self, dst: int, index: int, spec: BufferSpec, row_offset: int, rows: torch.Tensor) -> None:
        rows = rows.to(self.device, non_blocking=True).contiguous()
        target = self._buffers[index].data_ptr() + row_offset * spec.row_bytes
        held = self._pending.pop(dst, None)
        if held is not None:
            self._issue_put(dst, *held)
        self._pending[dst] = (target, rows.data_ptr(), rows.numel() * rows.element_size(), rows)

    def _issue_put(self, dst: int, target: int, source: int, nbytes: int, rows: torch.Tensor) -> None:
        self._bind.putmem_on_stream(target, source, nbytes, dst, self._stream_ptr)
        rows.record_stream(self.stream)  # the allocator keeps the source until the stream has sent it
        self._unquieted = True

    def _signal(self, dst: int, flag: int, value: int) -> None:
        held = self._pending.pop(dst, None)
        if self._unquieted:  # earlier puts (to any peer) complete before this signal can be seen
            self._bind.quiet_on_stream(self._stream_ptr)
            self._unquieted = False
        if held is None:
            self._bind.signal_op_on_stream(self._flag_ptr(flag), value, self._signal_set, dst, self._stream_ptr)
        else:
            target, source, nbytes, rows = held
            self._bind.putmem_signal_on_stream(
                target, source, nbytes, self._flag_ptr(flag), value, self._signal_set, dst, self._stream_ptr
            )
            rows.record_stream(self.stream)

    def _wait(self, flag: int, value: int, timeout_s: float) -> int:
        seen = poll_until(lambda: self._read_flag(flag), value, time.monotonic() + timeout_s)
        if seen < value:
            raise FabricTimeout(flag, self.rank, value, seen, timeout_s)
        return seen

    def _read_flag(self, flag: int) -> int:
        with torch.cuda.stream(self._poll_stream):
            return int(self._flags[flag].item())

    def _close(self) -> None:
        for dst in list(self._pending):  # held-back puts still go out
            self._issue_put(dst, *self._pending.pop(dst))
        self._bind.quiet_on_stream(self._stream_ptr)
        torch.cuda.synchronize(self.device)
        for buf in self._buffers.values():
            self._core.free_tensor(buf)
        self._core.free_tensor(self._flags)
        self._buffers.clear()

    # ---- device-side wait (for captured graphs) --------------------------------------------------------------
    def wait_on_stream(self, flag: int, value: int) -> None:
        """Make this rank's stream wait until flag >= value (no host involvement)."""
        self._check_open()
        self._bind.signal_wait_until_on_stream(
            self._flag_ptr(self._check_flag(flag)), self._cmp_ge, self._check_value(value), self._stream_ptr
        )
