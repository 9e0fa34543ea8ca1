"""Pure rendering: ServedModel → Kubernetes objects (dicts). No I/O; golden-tested."""

from .args import engine_args, model_location
from .errors import RenderError
from .objects import (
    RenderContext,
    cache_claim,
    container_security_context,
    deployment,
    engine_env,
    kubelet_probes,
    render,
    route,
    service,
    service_monitor,
    to_yaml,
)

__all__ = [
    "RenderContext",
    "RenderError",
    "cache_claim",
    "container_security_context",
    "deployment",
    "engine_args",
    "engine_env",
    "kubelet_probes",
    "model_location",
    "render",
    "route",
    "service",
    "service_monitor",
    "to_yaml",
]
