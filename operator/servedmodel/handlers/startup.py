"""Operator start and stop: kopf settings, the shared Kubernetes client and the metrics server in memo."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from servedmodel.api import API_GROUP, names
from servedmodel.config import OperatorConfig
from servedmodel.k8s import KubeClient

from . import metrics

# kopf keeps its per-object bookkeeping (handler progress, last-handled spec) in annotations under
# this prefix, never in status: the status schema has no room for `status.kopf`, and the reconciler
# and the probe share status through server-side apply.
ANNOTATION_PREFIX = API_GROUP
FINALIZER = f"{API_GROUP}/finalizer"


def operator_config(memo: Any) -> OperatorConfig:
    """The config `servedmodel run` put in memo, or one from the environment (kopf run, tests)."""
    config = getattr(memo, "config", None)
    if not isinstance(config, OperatorConfig):
        config = OperatorConfig()
        memo.config = config
    return config


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    config = operator_config(memo)
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Timers and daemons (resync, probe) make kopf hold a finalizer so it can stop them before the
    # object goes; name it after the API. Children need none: owner references garbage-collect them.
    settings.persistence.finalizer = FINALIZER
    # Only Events the handlers post explicitly (transitions), not every log line.
    settings.posting.enabled = True
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    # Watches: the server closes the stream after server_timeout; a silent stream is abandoned later.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Only the operator's children: the Deployment and Pod watches are filtered by the API server.
    children = f"app.kubernetes.io/managed-by={names.MANAGED_BY}"
    settings.watching.label_selectors["apps", "v1", "deployments"] = children
    settings.watching.label_selectors["v1", "pods"] = children
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10

    client = memo.client = KubeClient.from_environment()
    metrics.KUBE_REQUESTS.set_function(lambda: client.request_count)
    memo.locks = {}  # (namespace, name) -> asyncio.Lock: one reconcile at a time per ServedModel
    memo.needs_apply = set()  # ServedModels whose last apply failed; the resync applies again
    memo.refresh_pending = set()  # ServedModels with a coalesced status refresh pending
    bind = getattr(memo, "bind_address", "0.0.0.0")
    memo.metrics_server = metrics.serve(config.metrics_port, bind)
    logger.info(
        "servedmodel operator: API %s (%s); metrics on :%s",
        memo.client.credentials.server,
        memo.client.credentials.source,
        config.metrics_port or "off",
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    client = getattr(memo, "client", None)
    if isinstance(client, KubeClient):
        await client.aclose()
    served = getattr(memo, "metrics_server", None)
    if served is not None:
        server, _thread = served
        await asyncio.to_thread(server.shutdown)
