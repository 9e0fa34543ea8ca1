"""How many probe slots each namespace may hold at once: max-min fair shares of the slots, sized from each
namespace's demand. Pure; the scheduler feeds it and applies the caps.

A namespace's demand is the number of cycles it keeps in flight on average, Little's law: its cycles
started per second (the sum of 1 / spec.probe.interval over its models) times how long its cycles take,
plus a Poisson margin for the jittered due times that bunch up (3 standard deviations, and one more
slot). The slots are then shared out by water-filling: namespaces that ask for less than an even split
get all they ask for, the rest split what is left evenly. So one tenant with 1,000 models gets every slot
it needs while alone, and a tenant whose engines never answer (cycles that last minutes: a huge demand)
holds at most an even split of what the others leave, never the slots they need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

# Cycle seconds assumed for a namespace none of whose cycles has ended yet.
DEFAULT_CYCLE_S: Final = 1.0
# Weight of the newest cycle in a namespace's mean cycle seconds (exponentially weighted).
CYCLE_EWMA_ALPHA: Final = 0.2


def demand(rate_per_s: float, cycle_s: float) -> float:
    """Slots a namespace needs: its mean cycles in flight (rate times duration), and a margin for
    bunched starts."""
    mean = max(0.0, rate_per_s) * max(0.0, cycle_s)
    return mean + 3.0 * math.sqrt(mean) + 1.0


def mean_cycle_s(previous: float | None, took_s: float) -> float:
    """The namespace's mean cycle seconds after one more cycle that took `took_s`."""
    if previous is None:
        return took_s
    return previous + CYCLE_EWMA_ALPHA * (took_s - previous)


def fair_shares(demands: Mapping[str, float], slots: int) -> dict[str, int]:
    """Each namespace's cap: max-min fair shares of `slots` (at least 1 each, however many namespaces).

    Ascending demand, each takes what it asks for (rounded up) or an even split of what is left,
    whichever is less; the last takes the remainder of that split's rounding."""
    shares: dict[str, int] = {}
    left = max(1, slots)
    ordered = sorted(demands.items(), key=lambda item: item[1])
    for i, (namespace, asked) in enumerate(ordered):
        even = left // (len(ordered) - i)
        take = max(1, min(math.ceil(asked), even))
        shares[namespace] = take
        left = max(0, left - take)
    return shares
