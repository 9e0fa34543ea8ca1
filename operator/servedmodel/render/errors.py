"""Specs that pass the schema but cannot be rendered: the reconciler turns these into InvalidSpec."""

from __future__ import annotations


class RenderError(ValueError):
    """A spec the CRD let through that still cannot become objects; `field` is its path (spec.engine.…)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
