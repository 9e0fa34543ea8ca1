"""spec.workers → a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) `<name>` instead of the Deployment. Pure.

Each replica is a group of `size` pods: the leader runs vLLM's API server, the workers join it, as vLLM's
own LWS guide runs its multi-node mode (docs.vllm.ai, deployment/frameworks/lws, the multiprocessing
example): every pod runs `vllm serve` with `--pipeline-parallel-size <size> --nnodes $(LWS_GROUP_SIZE)
--node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)`, the workers with `--headless` (no
API server). LWS's pod webhook puts LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX into every
container; the kubelet expands `$(VAR)` in args from the container's env.

The pod templates are the Deployment's (render/objects.deployment: env, volumes, security, the readiness
gate), with the revision label taken over both templates. The workers of a vLLM group serve no HTTP, so
they have no /health probes; the simulator's workers do serve its HTTP (the probe checks each worker's
/health and /metrics where it answers: probe/group.py). The group is recreated when one of its pods
restarts (RecreateGroupOnPodRestart: a pipeline stage cannot rejoin a running engine), and the
Service (render/objects.service) selects the leaders only.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Final

from servedmodel.api import ServedModel, names
from servedmodel.api.base import Obj

from .errors import RenderError
from .meta import child_metadata

LWS_API: Final = "leaderworkerset.x-k8s.io/v1"
# vLLM's multi-node flags, from the env LWS's pod webhook injects (kubelet expands $(VAR) in args).
MULTI_NODE_ARGS: Final = (
    "--nnodes",
    "$(LWS_GROUP_SIZE)",
    "--node-rank",
    "$(LWS_WORKER_INDEX)",
    "--master-addr",
    "$(LWS_LEADER_ADDRESS)",
)
WORKER_ONLY_ARGS: Final = ("--headless",)
# Flags spec.workers derives: extraArgs repeating one would leave vLLM to pick the last silently.
GROUP_FLAGS: Final = ("--pipeline-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--headless")
KUBELET_PROBES: Final = ("startupProbe", "readinessProbe", "livenessProbe")


def group_args(args: list[str], size: int, *, worker: bool) -> list[str]:
    """The engine's args for one pod of a group: the model's, then the pipeline over `size` pods and
    vLLM's multi-node flags (and --headless for a worker)."""
    out = [*args, "--pipeline-parallel-size", str(size), *MULTI_NODE_ARGS]
    return [*out, *WORKER_ONLY_ARGS] if worker else out


def group_revision(leader: Obj, worker: Obj) -> str:
    """One revision over both templates (without their revision labels): a change to either is a new
    revision of the group."""

    def bare(template: Obj) -> Obj:
        meta = dict(template.get("metadata") or {})
        labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != names.REVISION_LABEL}
        return {**template, "metadata": {**meta, "labels": labels}}

    body = {"leader": bare(leader), "worker": bare(worker)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]


def leader_worker_set(cr: ServedModel, deployment: Obj, worker_resources: Obj | None = None) -> Obj:
    """The LeaderWorkerSet for spec.workers, from the Deployment render made for the same spec;
    `worker_resources`: the workers' container resources (spec.workers.resources rendered as the
    leader's are), None for the leader's."""
    workers = cr.spec.workers
    assert workers is not None
    for extra in cr.spec.engine.extra_args:
        flag = extra.split("=", 1)[0].replace("_", "-")
        if flag in GROUP_FLAGS:
            raise RenderError(
                "spec.engine.extraArgs", f"{flag} is derived from spec.workers; do not pass it as well"
            )
    dep_spec = deployment["spec"]
    leader = copy.deepcopy(dep_spec["template"])
    worker = copy.deepcopy(dep_spec["template"])
    lead_c = leader["spec"]["containers"][0]
    work_c = worker["spec"]["containers"][0]
    lead_c["args"] = group_args(lead_c["args"], workers.size, worker=False)
    work_c["args"] = group_args(work_c["args"], workers.size, worker=True)
    if worker_resources is not None:
        work_c["resources"] = worker_resources
    if cr.spec.engine.kind == "vllm":
        # A headless vLLM worker serves no HTTP: no port, no /health to probe.
        work_c.pop("ports", None)
        for probe in KUBELET_PROBES:
            work_c.pop(probe, None)
    revision = group_revision(leader, worker)
    for template in (leader, worker):
        labels = {**template["metadata"]["labels"], names.REVISION_LABEL: revision}
        template["metadata"]["labels"] = dict(sorted(labels.items()))
    replicas: Obj = {"replicas": cr.spec.replicas}
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": child_metadata(cr, names.leader_worker_set_name(cr.name)),
        "spec": {
            **replicas,
            # Workers start with their leader, not after it is Ready: the leader's readiness gate opens
            # only once the probe passed on the whole group (LeaderReady would wait forever).
            "startupPolicy": "LeaderCreated",
            # Like the Deployment: replace a group, never surge a second one onto the GPUs.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "leaderWorkerTemplate": {
                "size": workers.size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
