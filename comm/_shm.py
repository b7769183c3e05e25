"""Named shared-memory segments owned by nanocp rather than by multiprocessing's resource tracker.

`multiprocessing.shared_memory` registers every segment a process opens with the resource tracker, which
unlinks (and warns about) segments at process exit even when another process still uses them. nanocp owns
its segments explicitly: the creating rank unlinks them in `close()`, and `unlink_prefix()` sweeps what a
crashed session left behind. Buffers are mapped as tensors with `torch.from_file` so a tensor owns its
mapping: closing a fabric never fails because a caller still holds a buffer view.
"""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing import resource_tracker, shared_memory

import torch

SHM_DIR = "/dev/shm"

_TRACKER_LOCK = threading.Lock()


class _NoTracking:
    """Context manager that silences resource-tracker (un)registration (Python < 3.13 has no track=False)."""

    def __enter__(self):
        _TRACKER_LOCK.acquire()
        self._saved = resource_tracker.register, resource_tracker.unregister
        resource_tracker.register = resource_tracker.unregister = lambda name, rtype: None

    def __exit__(self, *exc):
        resource_tracker.register, resource_tracker.unregister = self._saved
        _TRACKER_LOCK.release()


def _open(name: str, create: bool, size: int = 0) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=create, size=size, track=False)
    with _NoTracking():
        return shared_memory.SharedMemory(name=name, create=create, size=size)


def _unlink(seg: shared_memory.SharedMemory) -> None:
    if sys.version_info >= (3, 13):
        seg.unlink()
        return
    with _NoTracking():
        seg.unlink()


def create_segment(name: str, nbytes: int) -> shared_memory.SharedMemory:
    """Create a new segment of `nbytes` (fails if the name exists); the caller must unlink it."""
    if nbytes <= 0:
        raise ValueError(f"shared-memory segment '{name}' needs a positive size, got {nbytes}")
    return _open(name, create=True, size=nbytes)


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment by name (FileNotFoundError if it does not exist yet)."""
    return _open(name, create=False)


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; mappings stay valid until unmapped. Returns False if it was already gone."""
    try:
        seg = attach_segment(name)
    except FileNotFoundError:
        return False
    try:
        _unlink(seg)
    except FileNotFoundError:
        return False
    finally:
        seg.close()
    return True


def map_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map an existing segment as a tensor that owns its mapping (Linux: segments live in /dev/shm)."""
    path = os.path.join(SHM_DIR, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"shared-memory segment '{name}' not found in {SHM_DIR}")
    numel = 1
    for dim in shape:
        numel *= dim
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def list_prefix(prefix: str) -> list[str]:
    """Names of the live segments whose name starts with `prefix`."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def unlink_prefix(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix` (crash cleanup); returns how many were removed."""
    return sum(unlink_segment(n) for n in list_prefix(prefix))


def require_shm_dir() -> None:
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"shared-memory backends need POSIX shared memory mounted at {SHM_DIR} (Linux)")
