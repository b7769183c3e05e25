"""Prefill latency model of Tetris (Eq. 1) and its least-squares fit.

For a chunk of `L` new tokens whose request already has `C` computed (historical) tokens, the prefill latency on an
SP group of size `s` is modelled as

    T_s(C, L) = a_s + b_s * L + c_s * C * L + d_s * L^2

(a: fixed overhead, b: linear layers, c: attention against the history, d: causal attention inside the chunk).
A `PrefillLatencyModel` holds one coefficient set per SP size for one attention mode ("ring" or "ulysses"); profile
files (prefill/profiles/*.json) hold one or more modes plus their provenance.

All coefficients are non-negative and b_s + d_s > 0, so T_s is strictly increasing in L for L >= 0; the chunk
solver relies on that.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILE_FORMAT = "nanocp.prefill_latency_profile/1"


class LatencyModelError(ValueError):
    """Bad coefficients, samples or profile files."""


@dataclass(frozen=True)
class LatencyCoeffs:
    """Coefficients of Eq. 1 for one SP size (seconds, seconds/token, seconds/token^2, seconds/token^2)."""

    a: float
    b: float
    c: float
    d: float

    def __post_init__(self) -> None:
        values = (self.a, self.b, self.c, self.d)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise LatencyModelError(f"latency coefficients must be finite numbers, got {values}")
        if min(values) < 0:
            raise LatencyModelError(f"latency coefficients must be non-negative, got {values}")
        if self.b + self.d <= 0:
            raise LatencyModelError(f"b + d must be > 0 so that latency grows with the chunk length, got {values}")

    def __call__(self, context: int, tokens: int) -> float:
        # The evaluation order is part of the contract: the C++ planner evaluates the same expression.
        return self.a + self.b * tokens + self.c * context * tokens + self.d * tokens * tokens

    def as_list(self) -> list[float]:
        return [self.a, self.b, self.c, self.d]


@dataclass(frozen=True)
class FitQuality:
    """Goodness of a fit on its samples: R^2 of the latencies and relative errors |pred - t| / t."""

    r2: float
    max_rel_err: float
    mean_rel_err: float
    num_samples: int


def _as_samples(samples: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    arr = np.asarray(samples, dtype=np.float64)  # [n, 3]: context, tokens, seconds
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise LatencyModelError("samples must be a non-empty sequence of (context, tokens, seconds) triples")
    if not np.all(np.isfinite(arr)):
        raise LatencyModelError("samples must be finite")
    if np.any(arr[:, 0] < 0) or np.any(arr[:, 1] <= 0) or np.any(arr[:, 2] <= 0):
        raise LatencyModelError("samples need context >= 0, tokens > 0 and seconds > 0")
    return arr


def _design(context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(tokens), tokens, context * tokens, tokens * tokens], axis=1)  # [n, 4]


def evaluate_fit(coeffs: LatencyCoeffs, samples: Sequence[Sequence[float]] | np.ndarray) -> FitQuality:
    """R^2 and relative errors of `coeffs` on `samples` (context, tokens, seconds)."""
    arr = _as_samples(samples)
    pred = _design(arr[:, 0], arr[:, 1]) @ np.asarray(coeffs.as_list())  # [n]
    seconds = arr[:, 2]
    ss_res = float(np.sum((pred - seconds) ** 2))
    ss_tot = float(np.sum((seconds - seconds.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(pred - seconds) / seconds
    return FitQuality(r2=r2, max_rel_err=float(rel.max()), mean_rel_err=float(rel.mean()), num_samples=len(arr))


def fit(samples: Sequence[Sequence[float]] | np.ndarray, relative: bool = True) -> tuple[LatencyCoeffs, FitQuality]:
    """Least-squares fit of Eq. 1 to (context, tokens, seconds) samples, coefficients constrained to be >= 0.

    relative=True weights every residual by 1/seconds (minimises relative error; latencies span orders of
    magnitude). The non-negativity constraint is solved exactly by trying every support of the 4 coefficients
    and keeping the feasible least-squares solution with the smallest residual.
    """
    arr = _as_samples(samples)
    design = _design(arr[:, 0], arr[:, 1])  # [n, 4]
    seconds = arr[:, 2]
    weight = 1.0 / seconds if relative else np.ones_like(seconds)  # [n]
    scale = np.abs(design).max(axis=0)  # [4] column scaling keeps lstsq well conditioned
    scale[scale == 0] = 1.0
    lhs = design / scale * weight[:, None]
    rhs = seconds * weight
    best: tuple[float, np.ndarray] | None = None
    for support in itertools.product((False, True), repeat=4):
        cols = [i for i in range(4) if support[i]]
        if not (support[1] or support[3]):
            continue  # b + d > 0 is required
        sol, *_ = np.linalg.lstsq(lhs[:, cols], rhs, rcond=None)
        if np.any(sol < 0):
            continue
        full = np.zeros(4)
        full[cols] = sol
        residual = float(np.sum((lhs @ full - rhs) ** 2))
        if best is None or residual < best[0]:
            best = (residual, full)
    if best is None:
        raise LatencyModelError("no non-negative fit with b + d > 0 exists for these samples")
    a, b, c, d = (float(v) for v in best[1] / scale)
    coeffs = LatencyCoeffs(a, b, c, d)
    return coeffs, evaluate_fit(coeffs, arr)


def largest_len_within(coeffs: LatencyCoeffs, context: int, budget: float, limit: int | None = None) -> int:
    """Largest integer L (<= limit) with T(context, L) <= budget; 0 if even L = 1 does not fit.

    Closed-form root of the quadratic in L (numerically stable form), then an integer bracketing correction so
    the answer is exact for the floating-point predicate T(C, L) <= budget. The C++ planner mirrors this.
    """
    if limit is not None and limit < 1:
        return 0
    if coeffs(context, 1) > budget:
        return 0
    if limit is not None and coeffs(context, limit) <= budget:
        return limit
    p = coeffs.b + coeffs.c * context
    q = coeffs.a - budget  # < 0 here because T(C, 1) <= budget
    if coeffs.d > 0:
        root = (-2.0 * q) / (p + math.sqrt(p * p - 4.0 * coeffs.d * q))
    else:
        root = -q / p
    length = max(1, math.floor(root))
    if limit is not None:
        length = min(length, limit)
    while (limit is None or length < limit) and coeffs(context, length + 1) <= budget:
        length += 1
    while length > 1 and coeffs(context, length) > budget:
        length -= 1
    return length


@dataclass
class PrefillLatencyModel:
    """Eq. 1 coefficients per SP size for one attention mode, with fit quality and provenance."""

    attention: str
    coeffs: dict[int, LatencyCoeffs]
    fit_quality: dict[int, FitQuality] = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.coeffs:
            raise LatencyModelError("a latency model needs coefficients for at least one SP size")
        for sp in self.coeffs:
            if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
                raise LatencyModelError(f"SP sizes must be positive ints, got {sp!r}")
        self.coeffs = dict(sorted(self.coeffs.items()))

    @property
    def sp_sizes(self) -> list[int]:
        return list(self.coeffs)

    def _coeffs(self, sp: int) -> LatencyCoeffs:
        if sp not in self.coeffs:
            raise LatencyModelError(f"no {self.attention} latency coefficients for SP size {sp}")
        return self.coeffs[sp]

    def latency(self, sp: int, context: int, tokens: int) -> float:
        """T_sp(context, tokens) in seconds."""
        if context < 0 or tokens < 0:
            raise LatencyModelError(f"context and tokens must be >= 0, got {context}, {tokens}")
        return self._coeffs(sp)(context, tokens)

    def solve_chunk_len(self, sp: int, context: int, budget: float, limit: int | None = None) -> int:
        """Largest chunk length L (<= limit if given) with T_sp(context, L) <= budget; 0 if none."""
        if context < 0:
            raise LatencyModelError(f"context must be >= 0, got {context}")
        return largest_len_within(self._coeffs(sp), context, budget, limit)

    @classmethod
    def fit_samples(
        cls,
        attention: str,
        samples_by_sp: dict[int, Sequence[Sequence[float]]],
        provenance: dict | None = None,
        relative: bool = True,
    ) -> PrefillLatencyModel:
        """Fit Eq. 1 separately for every SP size from (context, tokens, seconds) samples."""
        coeffs, quality = {}, {}
        for sp, samples in samples_by_sp.items():
            coeffs[sp], quality[sp] = fit(samples, relative=relative)
        return cls(attention, coeffs, quality, dict(provenance or {}))

    def to_dict(self) -> dict:
        return {
            "sp": {str(sp): c.as_list() for sp, c in self.coeffs.items()},
            "fit_quality": {str(sp): vars(q) for sp, q in self.fit_quality.items()},
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, attention: str, data: dict) -> PrefillLatencyModel:
        try:
            coeffs = {int(sp): LatencyCoeffs(*map(float, abcd)) for sp, abcd in data["sp"].items()}
            quality = {int(sp): FitQuality(**q) for sp, q in data.get("fit_quality", {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, LatencyModelError):
                raise
            raise LatencyModelError(f"malformed {attention!r} latency model: {exc}") from exc
        return cls(attention, coeffs, quality, dict(data.get("provenance", {})))

    def save(self, path: str | Path, name: str = "", description: str = "") -> None:
        save_profile(path, [self], name=name, description=description)

    @classmethod
    def load(cls, path: str | Path, attention: str | None = None) -> PrefillLatencyModel:
        """Load one mode of a profile file (the only/first mode when `attention` is None)."""
        models = load_profile(path)
        if attention is None:
            return models[0]
        for model in models:
            if model.attention == attention:
                return model
        raise LatencyModelError(f"{path} has no {attention!r} model (has {[m.attention for m in models]})")


def save_profile(
    path: str | Path,
    models: Sequence[PrefillLatencyModel],
    name: str = "",
    description: str = "",
    provenance: dict | None = None,
) -> None:
    """Write a profile file: one or more attention modes, each with coefficients, fit quality and provenance."""
    if not models:
        raise LatencyModelError("a profile needs at least one model")
    data = {
        "format": PROFILE_FORMAT,
        "name": name,
        "description": description,
        "provenance": dict(provenance or {}),
        "coefficient_order": ["a_s [s]", "b_s [s/token]", "c_s [s/token^2]", "d_s [s/token^2]"],
        "models": {m.attention: m.to_dict() for m in models},
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_profile(path: str | Path) -> list[PrefillLatencyModel]:
    """All attention modes of a profile file, in file order."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != PROFILE_FORMAT:
        raise LatencyModelError(f"{path}: expected format {PROFILE_FORMAT!r}, got {data.get('format')!r}")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise LatencyModelError(f"{path}: no models")
    return [PrefillLatencyModel.from_dict(attention, m) for attention, m in models.items()]


def profile_path(name: str) -> Path:
    """Path of a shipped profile, e.g. profile_path("a100-llama3-8b")."""
    path = PROFILE_DIR / f"{name}.json"
    if not path.exists():
        raise LatencyModelError(f"no shipped prefill profile named {name!r} in {PROFILE_DIR}")
    return path
