"""The driver thread runs as SCHED_BATCH while it drives instances in other processes, and only then: inside
`Engine.driving()` / `LLM.generate` on the processes backend, never with instances in the driver's own thread, not
with `driver_sched_batch=False`, and the thread's policy comes back afterwards (also after an error)."""

from __future__ import annotations

import os
import threading

import pytest

from nanocp import LLM, SamplingParams
from nanocp.driver_policy import batch_policy, batch_policy_available, own_policy

pytestmark = pytest.mark.skipif(not batch_policy_available(), reason="no SCHED_BATCH on this platform")


def policy() -> int:
    return os.sched_getscheduler(0)


def test_batch_policy_switches_the_calling_thread_and_restores_it():
    assert policy() == os.SCHED_OTHER
    seen = []
    ready, done = threading.Event(), threading.Event()

    def elsewhere() -> None:  # a thread that exists before the switch
        ready.wait()
        seen.append(policy())
        done.set()

    other = threading.Thread(target=elsewhere)
    other.start()
    with batch_policy() as switched:
        assert switched and policy() == os.SCHED_BATCH
        ready.set()
        done.wait()
        with own_policy():  # e.g. while starting processes, which would inherit the policy
            assert policy() == os.SCHED_OTHER
        assert policy() == os.SCHED_BATCH
    other.join()
    assert seen == [os.SCHED_OTHER]  # per thread: the process's other threads are untouched
    assert policy() == os.SCHED_OTHER
    with pytest.raises(RuntimeError), batch_policy():
        raise RuntimeError("boom")
    assert policy() == os.SCHED_OTHER
    with batch_policy(enabled=False) as switched:
        assert not switched and policy() == os.SCHED_OTHER


def test_a_thread_not_under_sched_other_is_left_alone():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        with batch_policy() as switched:
            assert not switched and policy() == os.SCHED_IDLE
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class PolicyProbe:
    """Wraps an engine's step to record the thread's policy while generate drives it."""

    def __init__(self, engine) -> None:
        self.seen: set[int] = set()
        step = engine.step

        def probed():
            self.seen.add(policy())
            return step()

        engine.step = probed


@pytest.mark.parametrize(
    ("backend", "enabled", "expected"),
    [("processes", True, os.SCHED_BATCH), ("processes", False, os.SCHED_OTHER), ("inline", True, os.SCHED_OTHER)],
)
def test_generate_drives_as_batch_only_with_instances_in_other_processes(backend, enabled, expected):
    with LLM("tiny", decode_instances=2, backend=backend, driver_sched_batch=enabled) as llm:
        probe = PolicyProbe(llm.engine)
        outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, temperature=0.0))
        assert [len(o.token_ids) for o in outs] == [3, 3]
        assert probe.seen == {expected}
    assert policy() == os.SCHED_OTHER


def test_instance_processes_started_while_driving_run_under_the_normal_policy():
    """A cluster built (or rebuilt after a failure) by a thread driving as SCHED_BATCH starts its instances as
    SCHED_OTHER: the policy is the driver thread's alone."""
    with batch_policy() as switched:
        assert switched
        llm = LLM("tiny", decode_instances=2, backend="processes")
    try:
        pids = [proc.pid for proc in llm.engine.cluster._procs]
        assert [os.sched_getscheduler(pid) for pid in pids] == [os.SCHED_OTHER] * 2
    finally:
        llm.close()
