"""Operator start and stop: kopf settings, one identity for kopf and our client, the watch-fed cache,
the controller (work queue + workers) and the probe scheduler, all kept in kopf's memo.

memo.config (OperatorConfig), memo.client (servedmodel.k8s.KubeClient), memo.cache (servedmodel.k8s.Cache),
memo.controller (servedmodel.controller.Controller: ``memo.controller.enqueue(namespace, name)``),
memo.probe_scheduler (servedmodel.probing.ProbeScheduler, started here through handlers/probe.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Final

import kopf

from servedmodel.api import API_GROUP, names
from servedmodel.config import OperatorConfig
from servedmodel.controller import Controller
from servedmodel.k8s import Cache, Identity, KubeClient, load_identity

from . import metrics

# Where kopf kept its bookkeeping before the control loop (annotations under this prefix) and the
# finalizer it held on every ServedModel for its timers and daemons; the reconciler removes both
# where it still finds them (reconcile.LEGACY_FINALIZER).
ANNOTATION_PREFIX: Final = API_GROUP
# Give kopf's first listings a moment to fill the cache before the first reconciles (a pass that ran
# before a ServedModel's Deployment arrived would apply it again: harmless, but a wasted request).
STARTUP_DELAY_S: Final = 2.0
CHILDREN_SELECTOR: Final = f"app.kubernetes.io/managed-by={names.MANAGED_BY}"


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's change detection, switched off: it serves on.create/update handlers and this operator has
    only on.event ones, yet kopf built the "essence" (two deep copies of the object) on every watch
    event of every kind, about 7 % of the operator's CPU at 1,000 ServedModels (py-spy). Nothing is
    stored either: the old last-handled-configuration annotations are removed where found
    (handlers/servedmodel.remove_legacy_bookkeeping)."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def operator_config(memo: Any) -> OperatorConfig:
    """The config `servedmodel run` put in memo, or one from the environment (kopf run, tests)."""
    config = getattr(memo, "config", None)
    if not isinstance(config, OperatorConfig):
        config = OperatorConfig()
        memo.config = config
    return config


def _identity(memo: Any) -> Identity:
    identity = getattr(memo, "identity", None)
    if not isinstance(identity, Identity):
        identity = memo.identity = load_identity()
    return identity


@kopf.on.login()
async def login(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> kopf.ConnectionInfo:
    """kopf's watches authenticate with the operator's identity (exec plugins, rotating tokens
    included): kopf calls this again when the expiration passes or the server answers 401."""
    identity = _identity(memo)
    refresh = bool(getattr(memo, "logged_in", False))  # a second login: the last credential failed
    memo.logged_in = True
    c = await identity.connection(refresh=refresh)
    return kopf.ConnectionInfo(
        server=c.server,
        ca_path=c.ca_path,
        ca_data=c.ca_data,
        insecure=c.insecure,
        certificate_path=c.certificate_path,
        certificate_data=c.certificate_data,
        private_key_path=c.private_key_path,
        private_key_data=c.private_key_data,
        token=c.credential.token,
        username=c.credential.username,
        password=c.credential.password,
        default_namespace=c.default_namespace,
        expiration=c.credential.expiration,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    config = operator_config(memo)
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = NoDiffBase()
    # Only event handlers: kopf holds no finalizer and writes no annotations. Events are posted by
    # the reconciler itself (before the status write that records the transition).
    settings.posting.enabled = False
    # Watches: the server closes the stream after server_timeout; a silent stream is abandoned later.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Only the operator's children: the child watches are filtered by the API server.
    for resource in (
        ("apps", "v1", "deployments"),
        ("v1", "pods"),
        ("v1", "services"),
        ("v1", "persistentvolumeclaims"),
    ):
        settings.watching.label_selectors[resource] = CHILDREN_SELECTOR
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # kopf runs one worker task per object with events (handlers of one object in order). No limit on
    # them (a limit of 64 with workers lingering idle_timeout after their last event let ~13 objects
    # a second through: the first passes of 1,000 new ServedModels queued behind it), and idle ones go
    # after 1 s instead of 5: the handlers only touch the cache, so a worker is cheap and short.
    settings.queueing.worker_limit = None
    settings.queueing.idle_timeout = 1.0
    # kopf logs "Handler ... succeeded." per watch event at INFO: thousands of lines a minute with
    # thousands of objects, none of them news. Its warnings and errors still show (all of it with -v).
    if not logging.getLogger("kopf").isEnabledFor(logging.DEBUG):
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    client = memo.client = KubeClient(
        _identity(memo), max_inflight=config.max_inflight_requests, read_timeout_s=config.api_timeout
    )
    cache = memo.cache = Cache()
    kinds = ("ServedModel", "Deployment", "Pod", "Service", "PersistentVolumeClaim")
    for kind in (*kinds, "HorizontalPodAutoscaler"):
        cache.track(kind)

    from .servedmodel import reconcile_key  # the reconcile entry point (handlers/servedmodel.py)

    async def reconcile_one(key: tuple[str, str]) -> Any:
        return await reconcile_key(memo, key)

    controller = memo.controller = Controller(
        reconcile_one,
        lambda: cache.keys("ServedModel"),
        workers=config.workers,
        backoff_base_s=config.backoff_base,
        backoff_cap_s=config.backoff_cap,
        resync_interval_s=config.resync_interval,
        logger=logging.getLogger("servedmodel.controller"),
    )
    metrics.watch_loop(client, cache, controller)
    bind = getattr(memo, "bind_address", "0.0.0.0")
    memo.metrics_server = metrics.serve(config.metrics_port, bind, metrics.authorizer(config, client))

    async def start_workers() -> None:
        await asyncio.sleep(STARTUP_DELAY_S)
        await controller.start()

    memo.controller_start = asyncio.create_task(start_workers())
    # The operator-wide probe scheduler (H5's servedmodel.probing) reads the same cache and enqueues
    # into the controller when Serving changes.
    from .probe import start_scheduler

    await start_scheduler(memo)
    logger.info(
        "servedmodel operator: API %s (%s); %d workers, %d API requests in flight at most, resync %ss; "
        "metrics on :%s",
        client.server,
        client.identity.source,
        config.workers,
        config.max_inflight_requests,
        config.resync_interval,
        config.metrics_port or "off",
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    from .probe import stop_scheduler

    await stop_scheduler(memo)
    starting = getattr(memo, "controller_start", None)
    if isinstance(starting, asyncio.Task):
        starting.cancel()
    controller = getattr(memo, "controller", None)
    if isinstance(controller, Controller):
        await controller.stop()
    client = getattr(memo, "client", None)
    if isinstance(client, KubeClient):
        await client.aclose()
    served = getattr(memo, "metrics_server", None)
    if served is not None:
        server, _thread = served
        await asyncio.to_thread(server.shutdown)
