"""The packed MoE exchange of the eager decode path, checked like the static-slab reference (DeepEP's checks):
what each rank receives is exactly the (token, expert) pairs routed to its experts, and the combine is the
gate-weighted sum of the expert outputs; both exchanges give the same combine."""

from __future__ import annotations

import numpy as np
import pytest
import tolerances as tol
import torch
from hypothesis import given
from hypothesis import strategies as st
from moe_reference import (
    combine_bound,
    exchange_cases,
    exchange_settings,
    expert_fn,
    random_routing,
    random_topk,
    reference_combine,
)

from nanocp.comm import InProcessFabric, LowLatencyDispatcher
from nanocp.comm.launch import run_threads
from nanocp.data_plane import cpu_kernels
from nanocp.data_plane.moe_exchange import PackedDispatcher, packed_layout


class PutOnlyFabric(InProcessFabric):
    """An in-process fabric that maps no peer buffer: rows travel by put, as over torch.distributed."""

    def _peer_buffer(self, dst: int, index: int) -> torch.Tensor | None:
        return None


def run_packed(world, xs, idxs, ws, num_experts, max_tokens, top_k, layers=1, fabric_cls=InProcessFabric):
    """Every rank dispatches, applies its experts to what it received, combines; `layers` rounds on the same
    buffers. Returns per rank a list of (received tokens [N, D], their global experts [N], source counts, out)."""
    fabrics = fabric_cls.create(world, num_flags=16)
    hidden = xs[0].shape[1]

    def rank_main(rank: int):
        disp = PackedDispatcher(fabrics[rank], num_experts, hidden, max_tokens, top_k, torch.float32)
        results = []
        for layer in range(layers):
            x = xs[rank] * (layer + 1)
            pending = disp.dispatch_send(x, idxs[rank])
            for flag, value in disp.wait_flags(pending):
                fabrics[rank].wait(flag, value, 30.0)
            received = disp.dispatch_finish(pending)
            tokens = disp.recv_x[torch.from_numpy(received.rows)].clone()
            experts = torch.from_numpy(received.local_expert) + rank * disp.local_experts
            disp.combine_send(expert_fn(tokens, experts), received)
            for flag, value in disp.combine_wait_flags(pending):
                fabrics[rank].wait(flag, value, 30.0)
            out = disp.combine_finish(pending, ws[rank], torch.float32)
            base = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
            with_base = disp.combine_finish(pending, ws[rank], torch.float32, base=base.clone())
            # fused or torch, the same sum: two fp32 evaluations, each within the combine's bound
            bound = 2 * combine_bound(xs[rank] * (layer + 1), idxs[rank], ws[rank], base)
            tol.assert_within(with_base, base + out, bound, "base")
            results.append((tokens, experts, received.source_counts, out))
        return results

    return run_threads(rank_main, world, timeout_s=60)


@exchange_settings
@exchange_cases
def test_packed_exchange_delivers_the_routing_and_combines_the_reference_combine(
    world, experts_per_rank, k, max_tokens, drop, seed
):
    num_experts, hidden = world * experts_per_rank, 8
    k = min(k, num_experts)
    gen = torch.Generator().manual_seed(seed)
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=gen)) for _ in range(world)]
    xs, idxs, ws = random_routing(tokens, hidden, k, num_experts, gen, drop)
    results = run_packed(world, xs, idxs, ws, num_experts, max_tokens, k, layers=2)
    for rank in range(world):
        own = range(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        for layer, (got, experts, counts, out) in enumerate(results[rank]):
            # source-major, each source's pairs by (expert, token): exactly its tokens routed to our experts
            want_rows, want_experts, want_counts = [], [], []
            for src in range(world):
                pairs = [(e, t) for t in range(tokens[src]) for e in idxs[src][t].tolist() if e in own]
                pairs.sort()
                want_counts.append(len(pairs))
                want_rows += [xs[src][t] * (layer + 1) for _, t in pairs]
                want_experts += [e for e, _ in pairs]
            assert counts == want_counts
            assert experts.tolist() == want_experts
            assert torch.equal(got, torch.stack(want_rows) if want_rows else got.new_zeros(0, hidden))
            want = reference_combine(xs[rank] * (layer + 1), idxs[rank], ws[rank])
            tol.assert_within(out, want, 2 * combine_bound(xs[rank] * (layer + 1), idxs[rank], ws[rank]))


@pytest.mark.parametrize("world", [2, 3])
def test_packed_exchange_by_put_equals_writing_in_place(world, cpu_kernel_path):
    """Peers' buffers written in place (Fabric.peer_buffer) or reached by put: the same bytes arrive."""
    gen = torch.Generator().manual_seed(world)
    tokens = [int(torch.randint(1, 7, (1,), generator=gen)) for _ in range(world)]
    xs, idxs, ws = random_routing(tokens, 8, 2, 2 * world, gen, 0.2)
    in_place = run_packed(world, xs, idxs, ws, 2 * world, 6, 2, layers=2)
    by_put = run_packed(world, xs, idxs, ws, 2 * world, 6, 2, layers=2, fabric_cls=PutOnlyFabric)
    for a, b in zip(in_place, by_put):
        for (tok_a, exp_a, cnt_a, out_a), (tok_b, exp_b, cnt_b, out_b) in zip(a, b):
            assert cnt_a == cnt_b and torch.equal(exp_a, exp_b)
            assert torch.equal(tok_a, tok_b) and torch.equal(out_a, out_b)


def test_experts_run_in_place_equal_the_exchange_in_steps(cpu_kernel_path):
    """The in-place expert pass (the receive buffer read and every source's combine buffer written by one kernel,
    then only a signal) combines bit for bit what reading, computing and sending in steps does; off the kernel path
    and over a fabric that can only put, there is no in-place pass."""
    from nanocp.data_plane.decode_layers import GroupedExperts, grouped_experts

    world, experts_per_rank, max_tokens, k, hidden, inter = 2, 3, 6, 2, 16, 8
    gen = torch.Generator().manual_seed(3)
    xs, idxs, ws = random_routing([max_tokens, 4], hidden, k, world * experts_per_rank, gen, 0.2)
    weights = [
        GroupedExperts(
            torch.randn(experts_per_rank, hidden, 2 * inter, generator=gen) * 0.1,
            torch.randn(experts_per_rank, inter, hidden, generator=gen) * 0.1,
        )
        for _ in range(world)
    ]

    def run(in_place: bool, fabric_cls=InProcessFabric):
        fabrics = fabric_cls.create(world, num_flags=16)

        def rank_main(rank: int):
            disp = PackedDispatcher(fabrics[rank], world * experts_per_rank, hidden, max_tokens, k, torch.float32)
            pending = disp.dispatch_send(xs[rank], idxs[rank])
            for flag, value in disp.wait_flags(pending):
                fabrics[rank].wait(flag, value, 30.0)
            experts, mapped = weights[rank], disp.in_place_combine is not None
            if in_place:
                recv, outs = disp.in_place_combine
                cpu_kernels.received_expert_mlp(recv, disp.cap, experts.gate_up_panels, experts.down_panels, outs)
                disp.combine_sent(pending.seq)
            else:
                received = disp.dispatch_finish(pending)
                disp.combine_send(grouped_experts(experts, disp.recv_x, received.rows, received.local_expert), received)
            for flag, value in disp.combine_wait_flags(pending):
                fabrics[rank].wait(flag, value, 30.0)
            return mapped, disp.combine_finish(pending, ws[rank], torch.float32)

        return run_threads(rank_main, world, timeout_s=60)

    by_steps = run(False, PutOnlyFabric)
    assert not any(mapped for mapped, _ in by_steps)
    if cpu_kernel_path == "torch":
        assert not any(mapped for mapped, _ in run(False))
        return
    in_place = run(True)
    assert all(mapped for mapped, _ in in_place)
    for (_, a), (_, b) in zip(in_place, by_steps):
        assert torch.equal(a, b)


@exchange_settings
@given(
    ranks=st.integers(1, 4),
    experts_per_rank=st.integers(1, 4),
    tokens=st.integers(0, 9),
    k=st.integers(1, 4),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_dispatch_layout_equals_the_numpy_layout(ranks, experts_per_rank, tokens, k, drop, seed):
    if cpu_kernels.unavailable_reason() is not None:
        pytest.skip(cpu_kernels.unavailable_reason())
    num_experts = ranks * experts_per_rank
    k = min(k, num_experts)
    idx = random_topk(tokens, k, num_experts, torch.Generator().manual_seed(seed), drop).numpy()
    cap = tokens * min(k, experts_per_rank)
    want = packed_layout(idx, num_experts, ranks, cap)
    got = cpu_kernels.moe_dispatch_layout(idx, num_experts, ranks, cap)
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:]):
        assert np.array_equal(g, w)
    if want[0]:
        with pytest.raises(ValueError, match="exceed its capacity"):
            cpu_kernels.moe_dispatch_layout(idx, num_experts, ranks, 0)
    # the one-pass form writes each rank's block (header, then its rows) where that rank's buffer takes it
    hidden = 8
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    blocks = [np.full((cap + 1, hidden + 1), np.nan, dtype=np.float32) for _ in range(ranks)]
    result_rows = np.empty_like(want[4])
    cpu_kernels.pack_dispatch(x, idx, num_experts, cap, blocks, result_rows)
    assert np.array_equal(result_rows, want[4])
    first = 0
    for block, count in zip(blocks, want[3].tolist()):
        assert block[0, hidden:].view(np.int32)[0] == count
        pairs = slice(first + 1, first + 1 + count)
        assert np.array_equal(block[1 : 1 + count, :hidden], x[torch.from_numpy(want[1][pairs])].numpy())
        assert np.array_equal(block[1 : 1 + count, hidden:].view(np.int32)[:, 0], want[2][pairs])
        first += 1 + count
    with pytest.raises(ValueError, match=rf"blocks\[0\] must be \[{cap + 1}, {hidden + 1}\]"):
        cpu_kernels.pack_dispatch(x, idx, num_experts, cap, [b[:, 1:] for b in blocks], result_rows)


def test_packed_exchange_combines_alike_on_both_paths(cpu_kernel_path):
    world, num_experts, max_tokens, k, hidden = 3, 6, 7, 3, 16
    gen = torch.Generator().manual_seed(11)
    xs, idxs, ws = random_routing([max_tokens] * world, hidden, k, num_experts, gen, 0.25)
    for rank, (_, _, _, out) in enumerate(r[0] for r in run_packed(world, xs, idxs, ws, num_experts, max_tokens, k)):
        bound = 2 * combine_bound(xs[rank], idxs[rank], ws[rank])
        tol.assert_within(out, reference_combine(xs[rank], idxs[rank], ws[rank]), bound)


def test_packed_and_static_slab_exchanges_combine_alike():
    world, num_experts, max_tokens, k, hidden = 4, 8, 5, 3, 16
    gen = torch.Generator().manual_seed(3)
    xs, idxs, ws = random_routing([max_tokens] * world, hidden, k, num_experts, gen, 0.2)
    packed = run_packed(world, xs, idxs, ws, num_experts, max_tokens, k)
    fabrics = InProcessFabric.create(world)

    def slab_main(rank: int) -> torch.Tensor:
        disp = LowLatencyDispatcher(fabrics[rank], num_experts, hidden, max_tokens, dtype=torch.float32)
        recv_x, _, handle = disp.dispatch(xs[rank], idxs[rank])
        local = torch.arange(rank * disp.local_experts, (rank + 1) * disp.local_experts)
        y = expert_fn(recv_x, local[:, None].expand(-1, recv_x.shape[1]))
        return disp.combine(y, idxs[rank], ws[rank], handle)

    slab = run_threads(slab_main, world, timeout_s=60)
    for rank in range(world):
        tol.assert_within(packed[rank][0][3], slab[rank], 2 * combine_bound(xs[rank], idxs[rank], ws[rank]))


def test_packed_exchange_rejects_bad_input():
    fabric = InProcessFabric.create(1)[0]
    disp = PackedDispatcher(fabric, num_experts=4, hidden=8, max_tokens_per_rank=2, top_k=2, dtype=torch.float32)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="same expert twice"):
        disp.dispatch_send(x, torch.tensor([[1, 1], [0, 2]]))
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        disp.dispatch_send(x, torch.tensor([[1, 4], [0, 2]]))
    with pytest.raises(ValueError, match="exceed"):
        disp.dispatch_send(torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="sized for"):
        disp.dispatch_send(x, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    with pytest.raises(TypeError, match="dtype"):
        disp.dispatch_send(x.double(), torch.tensor([[0, 1], [0, 2]]))
    with pytest.raises(ValueError, match="multiple"):
        PackedDispatcher(InProcessFabric.create(2)[0], 3, 8, 2, 2, torch.float32)
    pending = disp.dispatch_send(x, torch.tensor([[0, 1], [2, -1]]))
    received = disp.dispatch_finish(pending)
    assert received.source_counts == [3] and np.array_equal(received.local_expert, [0, 1, 2])
    with pytest.raises(ValueError, match="y must be"):
        disp.combine_send(torch.zeros(2, 8), received)
