"""Paged latent KV pool of one decode instance: [layers, frames, page_size, kv_lora + rope] (576 per token for V3).

Frames are the physical pages the global page table hands out for this instance. The pool is a plain tensor, so
another process (the prefill side) can write a prompt's KV straight into it when it lives in shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKVPool:
    kv: torch.Tensor  # [L, frames, page_size, Dkv]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        frames: int,
        page_size: int,
        dim: int,
        dtype: torch.dtype,
        shared: bool = False,
        device: torch.device | str = "cpu",
    ) -> PagedKVPool:
        """kv [num_layers, frames, page_size, dim] zeros; `shared`: in shared memory (CPU pools of other processes)."""
        kv = torch.zeros(num_layers, frames, page_size, dim, dtype=dtype, device=device)
        return cls(kv.share_memory_() if shared else kv)

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    @property
    def frames(self) -> int:
        return self.kv.shape[1]

    def write_tokens(self, layer: int, frames: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [n, Dkv] -> (frame, slot) pairs; frames/slots int64 [n]."""
        dev = self.kv.device
        self.kv[layer, frames.to(dev), slots.to(dev)] = values.to(dev, self.kv.dtype)

    def write_range(self, frames: list[int], start_slot: int, values: torch.Tensor) -> None:
        """Write values [L, n, Dkv] as a shard's tokens start_slot .. start_slot + n - 1 (pages in token order)."""
        n = values.shape[1]
        if n == 0:
            return
        slots = torch.arange(start_slot, start_slot + n)
        page = self.page_size
        frame_idx = torch.as_tensor(frames, dtype=torch.int64)[slots // page]
        dev = self.kv.device  # the values may come from a prefill on another device (the driver's CPU)
        self.kv[:, frame_idx.to(dev), (slots % page).to(dev)] = values.to(dev, self.kv.dtype)
