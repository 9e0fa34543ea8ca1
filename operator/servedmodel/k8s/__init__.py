"""The only code that talks to the Kubernetes API server: credentials, a typed async client, SSA."""

from .cache import Cache
from .client import (
    KNOWN_RESOURCES,
    ApiError,
    ConflictError,
    KubeClient,
    NotFoundError,
    Obj,
    ObjList,
    Resource,
    UnreachableError,
)
from .credentials import Credentials, CredentialsError, load_credentials

__all__ = [
    "KNOWN_RESOURCES",
    "ApiError",
    "Cache",
    "ConflictError",
    "Credentials",
    "CredentialsError",
    "KubeClient",
    "NotFoundError",
    "Obj",
    "ObjList",
    "Resource",
    "UnreachableError",
    "load_credentials",
]
