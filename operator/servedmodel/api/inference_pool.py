"""spec.inferencePool: the engine pods as a Gateway API Inference Extension InferencePool.

An endpoint picker (GIE's EPP) routes a Gateway's requests among the pool's pods by queue depth, KV
cache and LoRA affinity. Its pod reconciler keeps only pods that match the pool's selector *and* are
Ready (gateway-api-inference-extension v1.5.0, pkg/epp/controller/pod_reconciler.go: `!IsPodReady(pod)
|| !PoolLabelsMatch(pod.Labels)` removes the pod from the datastore), and the operator's readiness gate
makes an engine pod Ready only once a real streamed chat succeeded on it: so the pool routes only to
pods that really generate.

The pool is a field of the ServedModel, not a companion resource: every member pod belongs to some
ServedModel, whose gate decides its readiness; a pool spanning several ServedModels is one ServedModel
creating it (`create: true`, the default) and the others joining it by name (`create: false`). Members
are found by one label, `inference.servedmodel.io/inference-pool: <name>`, on every engine pod of every
ServedModel that names the pool.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .base import ApiModel, cel

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# The endpoint picker's ext-proc gRPC port in GIE's manifests.
DEFAULT_EPP_PORT = 9002


class EndpointPickerRef(ApiModel):
    """The endpoint picker (EPP) Service the Gateway asks which pod takes a request."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="The EPP's Service name."
    )
    port: int = Field(
        default=DEFAULT_EPP_PORT, ge=1, le=65535, description="The EPP Service's port (its ext-proc gRPC)."
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description=(
            "What the Gateway does while the EPP does not answer: FailClose refuses the request, FailOpen "
            "sends it to a pod the Gateway picks itself (ignoring readiness as the EPP sees it)."
        ),
    )


class InferenceObjectiveSpec(ApiModel):
    """An InferenceObjective on the pool: the priority of its requests in the EPP's flow control."""

    priority: int | None = Field(
        default=None,
        ge=-1000,
        le=1000,
        description="Higher is served first when requests queue; unset is 0 to the EPP.",
    )


class InferencePoolSpec(ApiModel):
    """An inference.networking.k8s.io/v1 InferencePool over the engine pods whose readiness gate is open."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!self.create || has(self.endpointPickerRef)",
                    "inferencePool.endpointPickerRef is required when the ServedModel creates the pool",
                    ".endpointPickerRef",
                ),
                cel(
                    "self.create || (!has(self.endpointPickerRef) && !has(self.objective))",
                    "inferencePool.create false joins a pool another ServedModel creates: endpointPickerRef "
                    "and objective belong to that one",
                    ".create",
                ),
            ]
        }
    )

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="The InferencePool's name (default: the ServedModel's), also the pods' pool label.",
    )
    create: bool = Field(
        default=True,
        description=(
            "Create the InferencePool (owned by this ServedModel). false: only join a pool of that name "
            "another ServedModel in the namespace creates (its pods get the pool's label)."
        ),
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        default=None, description="The endpoint picker of the pool (required when create)."
    )
    objective: InferenceObjectiveSpec | None = Field(
        default=None,
        description="Also create an InferenceObjective `<pool>` (inference.networking.x-k8s.io/v1alpha2).",
    )

    @model_validator(mode="after")
    def _create_needs_picker(self) -> InferencePoolSpec:
        if self.create and self.endpoint_picker_ref is None:
            raise ValueError(
                "inferencePool.endpointPickerRef is required when the ServedModel creates the pool"
            )
        if not self.create and (self.endpoint_picker_ref is not None or self.objective is not None):
            raise ValueError(
                "inferencePool.create false joins a pool another ServedModel creates: endpointPickerRef "
                "and objective belong to that one"
            )
        return self

    def pool_name(self, served_model: str) -> str:
        return self.name or served_model
