"""The driver thread's CPU scheduling policy while it drives decode instances that run in other processes.

An instance's answer wakes the driver. Under Linux's CFS a task woken after a sleep preempts the task running on its
core, and when the cores are fewer than the driver plus the instances, that task is an instance in the middle of an
iteration: its EP group then waits for it at the next exchange, so the driver's planning stalls every instance. As
SCHED_BATCH the driver is never a wakeup preemptor: it runs when a core comes free (an instance waiting for its
peers, or the next scheduler tick). Measured on this project's 2-vCPU VM, 2 instance processes at batch 64:
bench/results/driver_policy.md.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_switched = threading.local()  # .on: this thread runs as SCHED_BATCH because batch_policy switched it


def batch_policy_available() -> bool:
    return hasattr(os, "SCHED_BATCH") and hasattr(os, "sched_setscheduler")


@contextmanager
def batch_policy(enabled: bool = True) -> Iterator[bool]:
    """Run the calling thread as SCHED_BATCH inside the block; its previous policy comes back on exit. Nothing
    changes when disabled, off Linux, or when the thread is not SCHED_OTHER (real-time or already batch / idle:
    left alone). Yields whether the policy was switched."""
    if not enabled or not batch_policy_available() or os.sched_getscheduler(0) != os.SCHED_OTHER:
        yield False
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # refused (e.g. a seccomp filter): run as we are
        yield False
        return
    _switched.on = True
    try:
        yield True
    finally:
        _switched.on = False
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


@contextmanager
def own_policy() -> Iterator[None]:
    """Inside a batch_policy block, the thread's own policy (SCHED_OTHER) for the block: processes started there
    (decode instances, rebuilt after a failure) would otherwise inherit SCHED_BATCH. Elsewhere nothing changes."""
    if not getattr(_switched, "on", False):
        yield
        return
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
