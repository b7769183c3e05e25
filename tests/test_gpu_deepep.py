"""DeepEP low-latency dispatch/combine against the reference dispatcher (needs >= 2 GPUs, deep_ep, NCCL)."""

from __future__ import annotations

import pytest
import torch

from nanocp.comm import InProcessFabric, LowLatencyDispatcher
from nanocp.comm.launch import run_processes, run_threads
from nanocp.data_plane.backends.deepep import DeepEPDispatcher, deepep_unavailable_reason

WORLD, EXPERTS_PER_RANK, HIDDEN, TOKENS, TOPK, MAX_TOKENS = 2, 4, 7168, 24, 4, 32


def _gpu_reason() -> str | None:
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs, found {torch.cuda.device_count()}"
    return deepep_unavailable_reason(group=object())  # the group is made in the test's processes


REASON = _gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    experts = WORLD * EXPERTS_PER_RANK
    idx = torch.stack([torch.randperm(experts, generator=g)[:TOPK] for _ in range(TOKENS)])
    idx[torch.rand(TOKENS, TOPK, generator=g) < 0.1] = -1
    weights = torch.rand(TOKENS, TOPK, generator=g)
    return x, idx, weights


def expert_fn(y: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Row-wise experts (the result of a row does not depend on its slab position): f_e(x) = x * (e + 1)."""
    scale = torch.arange(first_expert, first_expert + y.shape[0], device=y.device, dtype=torch.float32) + 1
    return (y.float() * scale[:, None, None]).to(y.dtype)


def run(rank: int, dispatcher, device) -> tuple[torch.Tensor, torch.Tensor, list]:
    x, idx, w = (t.to(device) for t in inputs(rank))
    recv_x, recv_count, handle = dispatcher.dispatch(x, idx)
    recv = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    rows = [sorted(map(tuple, recv[e, dispatcher_rows(handle, e, dispatcher)].float().cpu()[:, :4].tolist()))
            for e in range(recv.shape[0])]  # fmt: skip
    y = expert_fn(recv, rank * EXPERTS_PER_RANK)
    out = dispatcher.combine(y, idx, w, handle)
    return out.float().cpu(), recv_count.cpu(), rows


def dispatcher_rows(handle, local: int, dispatcher) -> torch.Tensor:
    rows = getattr(handle, "expert_rows", None)
    if rows is not None:
        return rows(local)
    counts = handle.recv_layout[:, local].long()
    return torch.cat([torch.arange(s * dispatcher.max_tokens, s * dispatcher.max_tokens + int(n))
                      for s, n in enumerate(counts)])  # fmt: skip


def _deepep_rank(rank: int, world: int):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    dispatcher = DeepEPDispatcher(group, WORLD * EXPERTS_PER_RANK, HIDDEN, MAX_TOKENS)
    return run(rank, dispatcher, "cuda")


def test_deepep_matches_the_reference_dispatcher():
    fabrics = InProcessFabric.create(WORLD)

    def reference(rank: int):
        disp = LowLatencyDispatcher(fabrics[rank], WORLD * EXPERTS_PER_RANK, HIDDEN, MAX_TOKENS, torch.bfloat16)
        return run(rank, disp, "cpu")

    want = run_threads(reference, WORLD, timeout_s=120)
    got = run_processes(_deepep_rank, WORLD, timeout_s=600, torch_distributed=True)
    for (out, count, rows), (ref_out, ref_count, ref_rows) in zip(got, want):
        assert torch.equal(count, ref_count.to(count.dtype))
        assert rows == ref_rows  # the same tokens per expert (DeepEP's row order differs: compared sorted)
        assert float((out - ref_out).norm() / ref_out.norm()) < 1e-2  # bf16 weighted sum vs fp32 reference
