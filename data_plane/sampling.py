"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

A seeded request draws from a generator seeded by (seed, output index), so its tokens do not depend on which
instance samples it, on batch composition, or on preemption.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __reduce__(self):
        # pickled per request in every iteration's message to an instance process: rebuilt without re-validating
        return _params_from_fields, tuple(getattr(self, name) for name in _FIELD_NAMES)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _params_from_fields(*values) -> SamplingParams:
    """SamplingParams from its field values (validated when first made; copied as they are)."""
    params = object.__new__(SamplingParams)
    params.__dict__.update(zip(_FIELD_NAMES, values))
    return params


def sample_token(logits: torch.Tensor, params: SamplingParams, output_index: int, fallback_seed: int) -> int:
    """logits [vocab] -> one token id. `output_index` is the index of the token in the request's output."""
    if params.greedy:
        return int(torch.argmax(logits))
    shifted = logits.double() - logits.double().max()  # <= 0, so a tiny temperature cannot overflow
    probs = torch.softmax(shifted / params.temperature, dim=-1)  # [vocab]
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep_sorted = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p * sorted_probs.sum()
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    seed = params.seed if params.seed is not None else fallback_seed
    gen = torch.Generator().manual_seed((seed * 1_000_003 + output_index) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first maximum of each row of logits [a, vocab] (numpy's argmax on the CPU: the same first index, NaN
    included, a fraction of torch's per-call cost)."""
    if logits.is_cpu and not logits.requires_grad and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int], fallback_seeds: list[int]
) -> list[int]:
    """logits [a, vocab] -> a token per row, as `sample_token` row by row; greedy rows share one argmax."""
    greedy = [p.greedy for p in params]
    if all(greedy):
        return _argmax_rows(logits)
    best = _argmax_rows(logits) if any(greedy) else greedy
    return [
        best[r] if greedy[r] else sample_token(logits[r], params[r], output_indices[r], fallback_seeds[r])
        for r in range(len(params))
    ]
