"""WaterFill: split `total` tokens over instances so the peak post-allocation load is minimal (exact, integer)."""

from __future__ import annotations


def waterfill(loads: list[int], total: int) -> list[int]:
    """Return x with sum(x) == total, x >= 0, minimising max(loads[j] + x[j]).

    Lower-loaded instances are filled first. When the level does not divide evenly, the leftover tokens go one
    each to the filled instances in the order they appear in `loads` (the caller's participant order).
    """
    if total < 0:
        raise ValueError(f"waterfill: negative token count {total}")
    k = len(loads)
    if k == 0:
        raise ValueError("waterfill: no participants")
    order = sorted(range(k), key=lambda j: (loads[j], j))
    filled_sum = 0  # sum of loads of the m lowest participants
    m = 0
    while True:
        filled_sum += loads[order[m]]
        m += 1
        if m == k or m * loads[order[m]] - filled_sum >= total:
            break
    level, remainder = divmod(total + filled_sum, m)
    x = [0] * k
    for j in sorted(order[:m]):
        x[j] = level - loads[j]
        if remainder > 0:
            x[j] += 1
            remainder -= 1
    return x
