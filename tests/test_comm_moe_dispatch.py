"""Low-latency MoE dispatch/combine reference, checked the way DeepEP's own tests check its kernels."""

from __future__ import annotations

import pytest
import torch
from moe_reference import exchange_cases, exchange_settings, expert_fn, random_routing, random_topk, reference_combine

from nanocp.comm import InProcessFabric, LowLatencyDispatcher
from nanocp.comm.launch import run_threads


def run_moe(world, xs, idxs, ws, num_experts, max_tokens, dtype, iterations=1):
    """Every rank dispatches its tokens, applies the experts it owns, combines. Returns per rank a list
    (one entry per iteration) of (recv_x, recv_count, handle, out)."""
    fabrics = InProcessFabric.create(world)
    hidden = xs[0][0].shape[1]

    def rank_main(rank: int):
        disp = LowLatencyDispatcher(fabrics[rank], num_experts, hidden, max_tokens, dtype=dtype)
        local = torch.arange(rank * disp.local_experts, (rank + 1) * disp.local_experts)
        results = []
        for it in range(iterations):
            recv_x, count, handle = disp.dispatch(xs[it][rank], idxs[it][rank])
            snapshot = recv_x.clone()
            y = expert_fn(recv_x, local[:, None].expand(-1, recv_x.shape[1]))
            out = disp.combine(y, idxs[it][rank], ws[it][rank], handle)
            results.append((snapshot, count, handle, out))
        return results

    return run_threads(rank_main, world, timeout_s=60)


@exchange_settings
@exchange_cases
def test_dispatch_combine_match_deepep_semantics(world, experts_per_rank, k, max_tokens, drop, seed):
    num_experts, hidden = world * experts_per_rank, 8
    k = min(k, num_experts)
    gen = torch.Generator().manual_seed(seed)
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=gen)) for _ in range(world)]
    xs, idxs, ws = random_routing(tokens, hidden, k, num_experts, gen, drop)
    results = run_moe(world, [xs], [idxs], [ws], num_experts, max_tokens, torch.float32)
    for rank, [(recv_x, count, handle, out)] in enumerate(results):
        own = range(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        expect_count = [sum(int((idx == e).sum()) for idx in idxs) for e in own]
        assert count.dtype == torch.int32 and count.tolist() == expect_count
        for local, e in enumerate(own):
            for src in range(world):
                chosen = torch.nonzero((idxs[src] == e).any(1)).flatten()  # ascending token ids
                n = int(handle.recv_layout[src, local])
                assert n == chosen.numel()
                block = slice(src * max_tokens, src * max_tokens + n)
                # DeepEP compares received rows as a set; ours also fixes the order (ascending source token)
                assert torch.equal(recv_x[local, block], xs[src][chosen])
                assert handle.recv_src_token[local, block].tolist() == chosen.tolist()
                assert bool((handle.recv_src_token[local, src * max_tokens + n : (src + 1) * max_tokens] == -1).all())
        assert torch.equal(out, reference_combine(xs[rank], idxs[rank], ws[rank]))


def test_combine_is_bit_identical_for_any_rank_count():
    """The same 8 tokens spread over 1, 2 or 4 ranks combine to exactly the same bits (bf16)."""
    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, k, total = 8, 16, 4, 8
    x = torch.randn(total, hidden, generator=gen).to(torch.bfloat16)
    idx = random_topk(total, k, num_experts, gen, drop=0.2)
    w = torch.rand(total, k, generator=gen)
    outs = {}
    for world in (1, 2, 4):
        parts = [list(t.chunk(world)) for t in (x, idx, w)]
        results = run_moe(world, *([p] for p in parts), num_experts, total // world, torch.bfloat16)
        outs[world] = torch.cat([r[0][3] for r in results])
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[4])
    assert torch.equal(outs[1], reference_combine(x, idx, w))


def test_static_buffers_serve_repeated_iterations():
    world, num_experts, hidden, max_tokens, k = 2, 4, 8, 5, 2
    gen = torch.Generator().manual_seed(3)
    xs, idxs, ws = [], [], []
    for it in range(3):
        tokens = [5 - it, 2 + it]  # shrinking and growing batches leave stale rows behind
        for acc, part in zip((xs, idxs, ws), random_routing(tokens, hidden, k, num_experts, gen, drop=0.25)):
            acc.append(part)
    results = run_moe(world, xs, idxs, ws, num_experts, max_tokens, torch.float32, iterations=3)
    for rank in range(world):
        for it in range(3):
            recv_x, count, handle, out = results[rank][it]
            assert handle.seq == it + 1
            assert torch.equal(out, reference_combine(xs[it][rank], idxs[it][rank], ws[it][rank]))


def test_bad_input_is_rejected():
    fabric = InProcessFabric.create(1)[0]
    disp = LowLatencyDispatcher(fabric, 4, 8, 3, dtype=torch.float32)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="exceed max_tokens_per_rank"):
        disp.dispatch(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="same expert twice"):
        disp.dispatch(x, torch.tensor([[1, 1], [0, 2], [3, -1]]))
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        disp.dispatch(x, torch.tensor([[4], [0], [1]]))
    with pytest.raises(ValueError, match="int64"):
        disp.dispatch(x, torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype"):
        disp.dispatch(x.double(), torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden|\\[T, 8\\]"):
        disp.dispatch(torch.randn(3, 7), torch.zeros(3, 1, dtype=torch.int64))
    idx = torch.tensor([[0, -1], [-1, -1], [3, 1]])
    recv_x, count, handle = disp.dispatch(x, idx)
    assert count.tolist() == [1, 1, 0, 1]
    with pytest.raises(ValueError, match="y must be"):
        disp.combine(recv_x[:, :2], idx, torch.rand(3, 2), handle)
    with pytest.raises(ValueError, match="differs"):
        disp.combine(recv_x, torch.tensor([[0, -1], [-1, -1], [3, 2]]), torch.rand(3, 2), handle)
    out = disp.combine(recv_x, idx, torch.ones(3, 2), handle)
    assert torch.equal(out[1], torch.zeros(8)) and torch.equal(out[0], x[0]) and torch.equal(out[2], 2 * x[2])
    with pytest.raises(ValueError, match="multiple"):
        LowLatencyDispatcher(InProcessFabric.create(1)[0], 0, 8, 3)


def test_split_phases_drive_all_ranks_from_one_thread():
    """dispatch_send / wait_flags / dispatch_finish and the combine pair let one thread step every rank in
    lock-step (polling the flags instead of blocking) with the same result as the blocking calls."""
    world, num_experts, hidden, max_tokens, k = 3, 6, 8, 4, 2
    fabrics = InProcessFabric.create(world)
    disps = run_threads(
        lambda r: LowLatencyDispatcher(fabrics[r], num_experts, hidden, max_tokens, dtype=torch.float32), world
    )
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, hidden, generator=gen) for _ in range(world)]
    idxs = [random_topk(4, k, num_experts, gen, drop=0.2) for _ in range(world)]
    ws = [torch.rand(4, k, generator=gen) for _ in range(world)]

    def ready(rank, pending) -> bool:
        return all(fabrics[rank].read_flag(f) >= v for f, v in disps[rank].wait_flags(pending))

    pending = []
    for r in range(world):
        assert r == 0 or not ready(0, pending[0])  # rank 0 cannot finish before every rank has sent
        pending.append(disps[r].dispatch_send(xs[r], idxs[r]))
    assert all(ready(r, pending[r]) for r in range(world))
    handles = []
    for r in range(world):
        recv_x, count, handle = disps[r].dispatch_finish(pending[r])
        local = torch.arange(r * 2, r * 2 + 2)
        disps[r].combine_send(expert_fn(recv_x, local[:, None].expand(-1, recv_x.shape[1])), idxs[r], ws[r], handle)
        handles.append(handle)
    for r in range(world):
        assert ready(r, handles[r])
        out = disps[r].combine_finish(handles[r], ws[r], torch.float32)
        assert torch.equal(out, reference_combine(xs[r], idxs[r], ws[r]))
