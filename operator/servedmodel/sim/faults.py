"""Fault injection: what can go wrong between a client and a vLLM server, switchable by flag or at run time.

GET /admin/faults returns the current settings; POST /admin/faults merges a JSON object into them
(unknown keys → 400). POST with {"reset": true} restores the defaults.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any


@dataclasses.dataclass
class Faults:
    error_rate: float = 0.0  # share of requests answered with error_status at the door
    error_status: int = 500
    stall_after_tokens: int | None = None  # stream stops sending after N tokens, connection left open
    drop_after_tokens: int | None = None  # connection closed mid-stream after N tokens
    first_byte_delay_ms: float = 0.0  # delay before the response starts (slow proxy / cold path)
    malformed_chunk_rate: float = 0.0  # share of content chunks replaced by truncated JSON
    # The engine schedules nothing while /health stays 200 and /metrics keeps answering (a wedged engine
    # core, vLLM #39863): running requests make no progress, new ones wait; aborts wait for it too.
    engine_stalled: bool = False
    dead: bool = False  # engine died: /health 503, requests fail with 500
    ignore_stop: bool = False  # a server that ignores stop strings (the probe's stop-marker check)
    coalesce: bool = False  # the whole stream held back and delivered in one lump (a buffering proxy)
    chunk_tokens: int = 1  # tokens per content chunk (an API server lagging its engine merges outputs)
    chat_template: str | None = None  # swap the chat template at run time (bundled name, file or Jinja)

    def update(self, changes: dict[str, Any]) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"unknown fault settings: {', '.join(unknown)}")
        for key, value in changes.items():
            current = getattr(self, key)
            if key in ("stall_after_tokens", "drop_after_tokens"):
                value = None if value is None else int(value)
            elif key == "chat_template":
                value = None if value is None else str(value)
            elif isinstance(current, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be true or false")
            elif isinstance(current, (int, float)):
                value = type(current)(value)
            if key in ("error_rate", "malformed_chunk_rate") and not 0.0 <= value <= 1.0:
                raise ValueError(f"{key} must be between 0 and 1")
            if key == "chunk_tokens" and value < 1:
                raise ValueError("chunk_tokens must be at least 1")
            if key == "error_status" and not 400 <= value <= 599:
                raise ValueError("error_status must be an HTTP error status (400-599)")
            setattr(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hit(self, rng: random.Random, rate: float) -> bool:
        return rate > 0 and rng.random() < rate
