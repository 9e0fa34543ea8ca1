"""Pure: when the next probe runs. Jitter spreads many models' probes; failures back off (bounded)."""

from __future__ import annotations

import random

JITTER = 0.1  # ±10 % of the interval
MAX_BACKOFF_FACTOR = 4  # a failing endpoint is still probed at least every 4 intervals
NOT_READY_WAIT_S = 5.0


def next_delay(interval: float, consecutive_failures: int, rng: random.Random) -> float:
    """Seconds until the next cycle: interval * 2^(failures-1) capped at 4 * interval, jittered ±10 %."""
    factor = 1 if consecutive_failures <= 0 else min(2 ** (consecutive_failures - 1), MAX_BACKOFF_FACTOR)
    base = interval * factor
    return max(0.0, base * (1 + rng.uniform(-JITTER, JITTER)))
