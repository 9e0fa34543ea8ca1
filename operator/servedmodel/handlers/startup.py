"""Operator start and stop: kopf settings, the client, the watch-fed cache and its informers, the
controller (work queue + workers), the probe scheduler and leader election, all kept in kopf's memo.

Start-up order (client-go's): informers list and watch into the cache → once every one has synced,
the replica stands for leader election → as the leader it starts the workers (every cached ServedModel
enqueued) and the probe scheduler; losing the Lease stops both, and the informers go on (a follower's
cache stays warm). kopf runs the process (signals, login, start-up and clean-up) and no watch of its own.

memo.config (OperatorConfig), memo.client (servedmodel.k8s.KubeClient), memo.cache (servedmodel.k8s.Cache),
memo.informers (servedmodel.k8s.informer.Informers), memo.controller (servedmodel.controller.Controller:
``memo.controller.enqueue(namespace, name)``), memo.elector (servedmodel.k8s.leader.LeaderElector or
None), memo.probe_scheduler (servedmodel.prober.ProbeScheduler while this replica leads), memo.lease_loop
(servedmodel.probe.loop.ProbeLoop: the thread whose event loop runs the elector and the membership, with
their client memo.lease_client, so the Leases never wait for the workers' loop).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Iterable
from typing import Any, Final

import kopf

from servedmodel import watches
from servedmodel.config import OperatorConfig
from servedmodel.controller import Controller
from servedmodel.k8s import Cache, Identity, KubeClient, load_identity
from servedmodel.k8s.informer import Informer, Informers
from servedmodel.k8s.leader import LeaderElector, try_timeout
from servedmodel.k8s.members import Membership
from servedmodel.probe.loop import MAIN_WATCH_PERIOD_S, LoopWatch, ProbeLoop, calling, freeze_heap

from . import health, metrics

LEASE_NAME: Final = "servedmodel-operator"
SA_NAMESPACE_FILE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's change detection, switched off: this operator has no kopf resource handlers (its watches
    are k8s/informer.py's), so kopf must neither build nor store an "essence" of anything."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:  # pragma: no cover - kopf calls it only for resource handlers (none left)
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


def namespace_filter(namespaces: list[str]) -> tuple[list[str] | None, Any]:
    """(the namespaces to watch one by one, or None for cluster-wide; a filter for cluster-wide events).

    Exact names: one watch per namespace (a namespaced grant is enough). Globs ("team-*"): cluster-wide
    watches, filtered here (they need a cluster-wide grant, as kopf's globs needed one)."""
    if not namespaces:
        return None, None
    if any(any(ch in ns for ch in "*?[") for ns in namespaces):
        return None, lambda ns: any(fnmatch.fnmatchcase(ns, pattern) for pattern in namespaces)
    return sorted(set(namespaces)), None


def lease_name(config: OperatorConfig, namespaces: list[str]) -> str:
    if config.leader_election_id:
        return config.leader_election_id
    if not namespaces:
        return LEASE_NAME
    digest = hashlib.sha256(",".join(sorted(set(namespaces))).encode()).hexdigest()[:10]
    return f"{LEASE_NAME}-{digest}"


def lease_namespace(config: OperatorConfig, identity: Identity) -> str:
    if config.leader_election_namespace:
        return config.leader_election_namespace
    if os.environ.get("POD_NAMESPACE"):  # the Deployment's downward API
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or identity.namespace
    except OSError:
        return identity.namespace


def holder_identity() -> str:
    """Unique per process: the pod's name (in-cluster) or host, the pid and a random suffix."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{os.getpid()}_{secrets.token_hex(3)}"


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    try:
        await _start(settings, memo, logger)
    except BaseException:
        # kopf runs a failed startup again (60 s later): what this try started is stopped first, or the
        # next try finds its own metrics port bound (a CI run's operator never started so) and its
        # informers running twice.
        await _stop(memo)
        raise


async def _start(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger) -> None:
    config = operator_config(memo)
    settings.persistence.diffbase_storage = NoDiffBase()
    # Events are posted by the reconciler itself (before the status write that records the transition).
    settings.posting.enabled = False
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10

    client = memo.client = KubeClient(
        _identity(memo), max_inflight=config.max_inflight_requests, read_timeout_s=config.api_timeout
    )
    cache = memo.cache = Cache()

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
    namespaces: list[str] = list(getattr(memo, "namespaces", None) or [])
    scopes, keep = namespace_filter(namespaces)
    routes = watches.handlers(cache, controller)
    where: list[str | None] = [*scopes] if scopes else [None]
    informers = memo.informers = Informers(
        [
            Informer(
                client,
                w,
                cache,
                routes[w.kind],
                namespace=ns,
                relist_interval_s=config.relist_interval,
                namespace_filter=keep,
            )
            for w in watches.WATCHES
            for ns in where
        ]
    )
    for w in watches.WATCHES:
        cache.track(w.kind)
    informers.start()
    # The Lease's place and this process's name in it: shared by leader election and probe sharding.
    group_namespace, group, identity = (
        lease_namespace(config, client.identity),
        lease_name(config, namespaces),
        holder_identity(),
    )
    # The Leases get a client of their own, as controller-runtime's leader election does: a renewal never
    # waits behind the workers' requests for one of the shared client's in-flight slots (at load, 200
    # ServedModels on a busy machine, a leader sharing them missed its renew deadline eight times in five
    # minutes). Each request is bounded by the try timeout and not retried within a try: the next try is
    # the retry.
    lease_client = memo.lease_client = (
        KubeClient(
            client.identity,
            max_inflight=4,
            read_timeout_s=try_timeout(config.renew_deadline),
            attempts=1,
            user_agent="servedmodel-operator/leader-election",
        )
        if config.leader_election or config.probe_sharding
        else None
    )
    # ... and a thread and event loop of their own. On the main loop a renewal's every step queued behind
    # the workers' ready callbacks: at load ~26 on 2 cores the Lease requests took over 4 s and the leader
    # stepped down. Here they wait only for the GIL (0.5 ms switch interval, probe/loop.py).
    lease_loop = memo.lease_loop = None
    if lease_client is not None:
        # Its lag, what a renewal waits before it is sent: event_loop_lag_seconds{loop="leases"}.
        from .prober import PROBE_METRICS

        observe = PROBE_METRICS.loop_lag.labels("leases").observe
        watch = LoopWatch(MAIN_WATCH_PERIOD_S, MAIN_WATCH_PERIOD_S, observe)
        lease_loop = memo.lease_loop = ProbeLoop(name="servedmodel-leases", watch=watch)
        lease_loop.start()
    elector = memo.elector = (
        LeaderElector(
            lease_client,
            group_namespace,
            group,
            identity,
            lease_duration_s=config.lease_duration,
            renew_deadline_s=config.renew_deadline,
            retry_period_s=config.retry_period,
        )
        if lease_client is not None and config.leader_election
        else None
    )
    membership = memo.membership = (
        Membership(
            lease_client,
            group_namespace,
            group,
            identity,
            lease_duration_s=config.lease_duration,
            retry_period_s=config.retry_period,
        )
        if lease_client is not None and config.probe_sharding
        else None
    )
    clients = [client] if lease_client is None else [client, lease_client]
    metrics.watch_loop(clients, cache, controller, informers, elector)
    bind = getattr(memo, "bind_address", "0.0.0.0")
    memo.metrics_server = metrics.serve(config.metrics_port, bind, metrics.authorizer(config, client))
    memo.health_server = await health.serve(
        bind, config.health_port, informers, lambda: elector is None or elector.leading
    )

    from .prober import start_scheduler, stop_scheduler

    async def start_leading() -> None:
        await controller.start()
        for key in watches.leader_keys(cache):  # a new leader looks at everything once
            controller.enqueue(*key)
        if membership is None:  # with sharding, run() starts every replica's share, leader or not
            await start_scheduler(memo)

    async def stop_leading() -> None:
        if membership is None:
            await stop_scheduler(memo)
        await controller.stop()

    async def run() -> None:
        await informers.wait_synced()
        logger.info("caches synced: %s", ", ".join(f"{k} {cache.count(k)}" for k in cache.kinds()))
        # The imports and the first lists are here to stay: out of every later full collection, which
        # would otherwise stop the probe's thread for 100-260 ms each (probe/loop.py).
        logger.info("garbage collector: %d objects frozen", freeze_heap())
        if membership is not None and lease_loop is not None:
            memo.membership_task = await lease_loop.spawn(membership.run(), name="servedmodel-membership")
            await start_scheduler(memo)
        if elector is None or lease_loop is None:
            await start_leading()
            return
        main = asyncio.get_running_loop()

        async def elect() -> None:
            # On the Leases' loop; the leader's work starts and stops on this one.
            try:
                await elector.run(calling(main, start_leading), calling(main, stop_leading))
            except Exception:
                logger.exception("leader election stopped; this replica no longer stands")
                raise

        memo.elector_task = await lease_loop.spawn(elect(), name="servedmodel-leader-election")

    memo.supervisor = asyncio.create_task(run(), name="servedmodel-supervisor")
    logger.info(
        "servedmodel operator: API %s (%s); %d workers, %d API requests in flight at most, resync %ss, "
        "relist %ss; %s; metrics on :%s, health on :%s",
        client.server,
        client.identity.source,
        config.workers,
        config.max_inflight_requests,
        config.resync_interval,
        config.relist_interval,
        f"leader election on Lease {elector.namespace}/{elector.name} as {elector.identity}"
        if elector is not None
        else "no leader election",
        config.metrics_port or "off",
        config.health_port or "off",
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _stop(memo)


async def _stop(memo: kopf.Memo) -> None:
    """Stop whatever _start started, as far as it got (each part only if it is there)."""
    from .prober import stop_scheduler

    supervisor = getattr(memo, "supervisor", None)
    if isinstance(supervisor, asyncio.Task):
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
    lease_loop = getattr(memo, "lease_loop", None)
    if not isinstance(lease_loop, ProbeLoop):
        lease_loop = None
    elector_task, memo.elector_task = getattr(memo, "elector_task", None), None
    if lease_loop is not None and isinstance(elector_task, asyncio.Task):
        await lease_loop.cancel(elector_task)  # stops leading (workers, probe) and releases the Lease
    await stop_scheduler(memo)
    membership_task, memo.membership_task = getattr(memo, "membership_task", None), None
    if lease_loop is not None and isinstance(membership_task, asyncio.Task):
        await lease_loop.cancel(membership_task)  # deletes this replica's Lease: the others take its share
    controller = getattr(memo, "controller", None)
    if isinstance(controller, Controller):
        await controller.stop()
    informers = getattr(memo, "informers", None)
    if isinstance(informers, Informers):
        await informers.stop()
    client = getattr(memo, "client", None)
    if isinstance(client, KubeClient):
        await client.aclose()
    lease_client, memo.lease_client = getattr(memo, "lease_client", None), None
    closers = [lease_client.aclose] if isinstance(lease_client, KubeClient) else []
    if lease_loop is not None:
        await lease_loop.stop(closers)  # the Lease client is closed on the loop that used it
        memo.lease_loop = None
    else:
        for close in closers:
            await close()
    await _close_servers(memo)


async def _close_servers(memo: kopf.Memo) -> None:
    """Stop the metrics and health servers, if any (cleanup, and a startup that runs again)."""
    served, memo.metrics_server = getattr(memo, "metrics_server", None), None
    if served is not None:
        server, _thread = served
        await asyncio.to_thread(server.shutdown)
        server.server_close()
    runner, memo.health_server = getattr(memo, "health_server", None), None
    if runner is not None:
        await runner.cleanup()
