"""The only code that talks to the Kubernetes API server: one identity (shared with kopf's login), a
lightkube-based async client with server-side apply, and the watch-fed cache the control loop reads."""

from .cache import Cache
from .client import (
    KNOWN_RESOURCES,
    ApiError,
    ConflictError,
    GoneError,
    KubeClient,
    NotFoundError,
    ObjList,
    Resource,
    UnreachableError,
)
from .identity import Connection, Credential, CredentialsError, Identity, load_identity

__all__ = [
    "KNOWN_RESOURCES",
    "ApiError",
    "Cache",
    "ConflictError",
    "Connection",
    "Credential",
    "CredentialsError",
    "GoneError",
    "Identity",
    "KubeClient",
    "NotFoundError",
    "ObjList",
    "Resource",
    "UnreachableError",
    "load_identity",
]
