"""The ServedModel object as a whole: apiVersion/kind, the metadata the operator reads, spec, status."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from .base import API_GROUP, API_VERSION, ApiModel
from .spec import ServedModelSpec
from .status import ServedModelStatus

API_GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"
# The Service is `<name>-engine`, a DNS-1035 label of at most 63 characters.
MAX_NAME_LENGTH = 56
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ObjectMeta(ApiModel):
    """The part of metadata the operator reads; the rest (managedFields, …) is ignored, not rejected."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="Name of the ServedModel.")
    namespace: str | None = Field(default=None, description="Namespace.")
    uid: str | None = Field(default=None, description="UID, for owner references on the children.")
    generation: int | None = Field(default=None, description="Spec generation.")
    resource_version: str | None = Field(default=None, description="resourceVersion.")
    creation_timestamp: str | None = Field(default=None, description="Creation time.")
    labels: dict[str, str] | None = Field(default=None, description="Labels.")
    annotations: dict[str, str] | None = Field(default=None, description="Annotations.")


class ServedModel(ApiModel):
    """A model served by vLLM (or probed at an existing endpoint) with measured request-path latencies."""

    # No fieldPath: the root schema cannot describe metadata, so the message names the field.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                    "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
                    "(the Service <name>-engine must be a DNS label)",
                },
                {
                    "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
                    "message": "metadata.name must start with a letter (the Service <name>-engine is a "
                    "DNS-1035 label)",
                },
            ]
        }
    )

    api_version: Literal["inference.servedmodel.io/v1alpha1"] = Field(
        default="inference.servedmodel.io/v1alpha1", description="inference.servedmodel.io/v1alpha1."
    )
    kind: Literal["ServedModel"] = Field(default="ServedModel", description="ServedModel.")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: ServedModelSpec = Field(description="What to serve and how.")
    status: ServedModelStatus | None = Field(default=None, description="Observed state.")

    @model_validator(mode="after")
    def _name_fits_children(self) -> ServedModel:
        name = self.metadata.name
        if len(name) > MAX_NAME_LENGTH:
            raise ValueError(f"metadata.name must be at most {MAX_NAME_LENGTH} characters")
        if not re.match(NAME_PATTERN, name):
            raise ValueError("metadata.name must start with a letter and be a DNS label")
        return self

    @classmethod
    def from_body(cls, body: Any) -> ServedModel:
        """Parse a kopf body / API object (any Mapping); raises pydantic.ValidationError."""
        return cls.model_validate(dict(body))

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str | None:
        return self.metadata.namespace
