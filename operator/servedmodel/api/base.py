"""Shared pieces of the ServedModel API models: camelCase wire names and the one condition shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

API_GROUP = "inference.servedmodel.io"
API_VERSION = "v1alpha1"
KIND = "ServedModel"
PLURAL = "servedmodels"
SINGULAR = "servedmodel"
SHORT_NAMES = ["sm"]

# A Kubernetes object as JSON: what the API server returns, the watch-fed cache holds and render builds.
Obj = dict[str, Any]
# (namespace, name) of a namespaced object: the key of the work queue, the cache and the probe scheduler.
Key = tuple[str, str]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    """One x-kubernetes-validations entry; fieldPath makes the API server name the offending field."""
    out: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def to_camel(name: str) -> str:
    """snake_case → camelCase, leaving digits alone (e2e_ms → e2eMs, not pydantic's e2EMs)."""
    first, *rest = name.split("_")
    return first + "".join(part[:1].upper() + part[1:] for part in rest)


class ApiModel(BaseModel):
    """Base of every CR model: Python snake_case attributes, camelCase on the wire, no unknown keys.

    Every field carries a `description` (the CRD and the OpenShift console show it).
    Serialise with `model_dump(by_alias=True, exclude_none=True)`.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One condition, Kubernetes' shape (metav1.Condition)."""

    type: str = Field(description="Condition type, e.g. Ready, Progressing, Degraded, Serving, TemplateOK.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="CamelCase reason for the last transition, e.g. ProgressDeadlineExceeded."
    )
    message: str = Field(default="", description="Human-readable details.")
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )
    last_transition_time: str | None = Field(
        default=None, description="RFC 3339 time of the last status change of this condition."
    )
