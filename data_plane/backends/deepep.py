"""DeepEP low-latency dispatch/combine behind the interface of comm.moe_dispatch.LowLatencyDispatcher.

Uses DeepEP's legacy `deep_ep.Buffer` in low-latency mode (IBGDA / NVLink through NVSHMEM). Differences from the
reference it hides or exposes:
- completion is a receive hook on the GPU, not fabric flags: `wait_flags` is empty and `dispatch_finish` /
  `combine_finish` call the hooks;
- an expert's received rows are packed at the front of its slab (rows [0, recv_count)), with a (begin, count)
  range per source rank, instead of the reference's fixed per-source blocks: the handle's `expert_rows` says
  which rows hold tokens, and DeepGEMM's masked GEMM takes `masked_m = recv_count` directly;
- row order inside an expert is not deterministic, and the combine is a bf16 weighted sum.
DeepEP double-buffers: every dispatch and every combine switches buffers, so a strict dispatch/combine alternation
(one of each per MoE layer) keeps each dispatch in the same buffer, i.e. `recv_x` at a fixed address (checked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LAYOUT_COUNT_MASK = (1 << 32) - 1  # DeepEP packs (begin << 32) | count per (local expert, source rank)


def deepep_unavailable_reason(group=None) -> str | None:
    """Why DeepEP cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "DeepEP needs CUDA GPUs"
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        return f"deep_ep does not import ({e}); build it from source (docs/gpu.md)"
    if group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return "DeepEP needs an initialised torch.distributed process group (NCCL)"
    return None


@dataclass
class DeepEPPending:
    seq: int
    topk_idx: torch.Tensor  # int64 [T, k]
    tokens: int  # real tokens (the call pads an empty batch to one token that chooses no expert)
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_count: torch.Tensor  # int32 [local_experts]
    raw: tuple  # DeepEP's handle
    hook: Callable[[], None]


@dataclass
class DeepEPHandle:
    seq: int
    topk_idx: torch.Tensor
    tokens: int
    raw: tuple
    recv_count: torch.Tensor  # int32 [local_experts]
    recv_layout: torch.Tensor  # int32 [ranks, local_experts]: rows received from each source rank
    combined: torch.Tensor | None = None
    combine_hook: Callable[[], None] | None = None

    def expert_rows(self, local: int) -> torch.Tensor:
        """Rows of local expert `local` that hold tokens: DeepEP packs them at the front of the slab."""
        return torch.arange(int(self.recv_count[local]), device=self.recv_count.device)


class DeepEPDispatcher:
    name = "deepep"

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        num_experts: int,
        hidden: int,
        max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
        use_fp8: bool = False,
    ) -> None:
        reason = deepep_unavailable_reason(group)
        if reason is not None:
            raise RuntimeError(reason)
        import deep_ep

        ranks = group.size()
        if num_experts % ranks:
            raise ValueError(f"num_experts {num_experts} must be a multiple of the {ranks} ranks")
        if dtype != torch.bfloat16:
            raise TypeError(f"DeepEP dispatches bf16 tokens, the model runs in {dtype}")
        self.num_experts = num_experts
        self.local_experts = num_experts // ranks
        self.hidden = hidden
        self.max_tokens = max_tokens_per_rank
        self.dtype = dtype
        self.use_fp8 = use_fp8
        self.ranks = ranks
        rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, ranks, num_experts)
        self.buffer = deep_ep.Buffer(
            group, num_rdma_bytes=rdma_bytes, low_latency_mode=True, num_qps_per_rank=self.local_experts
        )
        self._seq = 0
        self._recv_x = None
        self._recv_ptr: int | None = None

    @classmethod
    def factory(cls, group: torch.distributed.ProcessGroup, use_fp8: bool = False):
        """A Backends.dispatcher: builds the dispatcher from DecodeInstance's arguments (the fabric is unused)."""

        def make(fabric, num_experts, hidden, max_tokens_per_rank, dtype, name, timeout_s):
            return cls(group, num_experts, hidden, max_tokens_per_rank, dtype, use_fp8)

        return make

    @property
    def recv_x(self):
        """The last dispatch's receive slabs [local_experts, ranks * max_tokens, hidden] (bf16, or (fp8, scales))."""
        if self._recv_x is None:
            raise RuntimeError("recv_x is defined after the first dispatch")
        return self._recv_x

    # ---- split phases, as the reference ---------------------------------------------------------------------
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor) -> DeepEPPending:
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != self.dtype:
            raise ValueError(f"x must be {self.dtype} [T, {self.hidden}], got {x.dtype} {tuple(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens_per_rank={self.max_tokens}")
        tokens = x.shape[0]
        if tokens == 0:  # one token that chooses no expert: every rank must take part in every dispatch
            x = x.new_zeros(1, self.hidden)
            topk_idx = torch.full((1, topk_idx.shape[1]), -1, dtype=torch.int64, device=x.device)
        self._seq += 1
        recv_x, recv_count, raw, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, self.max_tokens, self.num_experts, use_fp8=self.use_fp8, return_recv_hook=True
        )
        return DeepEPPending(self._seq, topk_idx, tokens, recv_x, recv_count, raw, hook)

    def wait_flags(self, pending) -> list[tuple[int, int]]:
        """No host-visible flags: completion is the GPU-side receive hook run by the finish calls."""
        return []

    def dispatch_finish(self, pending: DeepEPPending):
        pending.hook()
        data = pending.recv_x[0] if isinstance(pending.recv_x, tuple) else pending.recv_x
        if self._recv_ptr is None:
            self._recv_ptr = data.data_ptr()
        elif data.data_ptr() != self._recv_ptr:
            raise RuntimeError("DeepEP's receive buffer moved: dispatch and combine must strictly alternate")
        self._recv_x = pending.recv_x
        layout = (pending.raw[1] & LAYOUT_COUNT_MASK).to(torch.int32)  # [local_experts, ranks]
        handle = DeepEPHandle(
            pending.seq, pending.topk_idx, pending.tokens, pending.raw, pending.recv_count, layout.T.contiguous()
        )
        return pending.recv_x, pending.recv_count, handle

    def combine_send(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: DeepEPHandle
    ) -> None:
        if handle.tokens == 0:
            topk_idx, topk_weights = handle.topk_idx, topk_weights.new_zeros(handle.topk_idx.shape)
        combined, _, hook = self.buffer.low_latency_combine(
            y, topk_idx, topk_weights.float(), handle.raw, return_recv_hook=True
        )
        handle.combined, handle.combine_hook = combined, hook

    def combine_finish(self, handle: DeepEPHandle, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        handle.combine_hook()
        return handle.combined[: handle.tokens].to(dtype)

    # ---- one-call forms ---------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor):
        return self.dispatch_finish(self.dispatch_send(x, topk_idx))

    def combine(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: DeepEPHandle
    ) -> torch.Tensor:
        self.combine_send(y, topk_idx, topk_weights, handle)
        return self.combine_finish(handle, topk_weights, y.dtype)
