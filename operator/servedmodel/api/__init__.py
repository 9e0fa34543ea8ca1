"""The ServedModel API: pydantic v2 models of the CR, the CRD generated from them (crd.py)."""

from .base import API_GROUP, API_VERSION, KIND, PLURAL, SHORT_NAMES, SINGULAR, ApiModel, Condition
from .model import API_GROUP_VERSION, ObjectMeta, ServedModel
from .spec import (
    CacheSpec,
    ConfigMapKeyRef,
    EngineSpec,
    EnvVar,
    ExposeSpec,
    MonitoringSpec,
    ResourceList,
    ResourcesSpec,
    SecretKeyRef,
    ServedModelSpec,
    Toleration,
)
from .status import PHASES, Phase, ServedModelStatus

__all__ = [
    "API_GROUP",
    "API_GROUP_VERSION",
    "API_VERSION",
    "KIND",
    "PHASES",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "ApiModel",
    "CacheSpec",
    "Condition",
    "ConfigMapKeyRef",
    "EngineSpec",
    "EnvVar",
    "ExposeSpec",
    "MonitoringSpec",
    "ObjectMeta",
    "Phase",
    "ResourceList",
    "ResourcesSpec",
    "SecretKeyRef",
    "ServedModel",
    "ServedModelSpec",
    "ServedModelStatus",
    "Toleration",
]
