"""Engines for a rollout on the local control plane: kwok runs the engine pods, so their engines are
simulators on 127.0.0.1, mapped pod by pod through the operator's endpoint-override file.

`RevisionMapper` (a thread, every 0.3 s) writes that file from the ServedModel's live engine pods: the
first revision's pods go to `first`, any later revision's to `later` (both lists of base URLs; pods that
share a list get distinct URLs while there are enough, as each pod has its own engine). It also samples
the Service's EndpointSlice (ready endpoints per sample, once `sampling` is set) and, for a client, says
which engines the Service would send a request to now (`ready_urls`).
Used by tests/cluster/test_rollout_gate.py and bench/rollout_gate.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import controlplane

REVISION_LABEL = "inference.servedmodel.io/revision"  # servedmodel.api.names.REVISION_LABEL


def write_override(path: Path, lines: list[str]) -> None:
    """Replace the endpoint-override file in one step (a new file renamed over it). The operator reads
    it every probe cycle; a write in place can be read truncated or empty, and an empty override sends
    the probe to the pods' own (kwok, 10.244.x.x) addresses, which fail as no engine would."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)


class RevisionMapper(threading.Thread):
    def __init__(
        self,
        cp: controlplane.ControlPlane,
        namespace: str,
        name: str,
        path: Path,
        first: list[str],
        later: list[str],
    ) -> None:
        super().__init__(name="revision-mapper", daemon=True)
        self.cp, self.namespace, self.name, self.path = cp, namespace, name, path
        self.first, self.later = first, later  # `later` may be swapped while it runs
        self.first_revision: str | None = None
        self.ready_counts: list[int] = []
        self.sampling = False
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self._urls: dict[str, str] = {}  # pod name -> engine, as last written
        self._ready: list[str] = []  # the engines of the pods whose endpoint is ready, as last sampled
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            while not self.halt.wait(0.3):
                self.step()
        except BaseException as e:  # reported by whoever started it, not lost in a thread
            self.error = e

    def step(self) -> None:
        selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=engine"
        pods = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}")
        used: dict[int, int] = {}  # id(list) -> pods mapped to it so far
        urls: dict[str, str] = {}
        terminating: dict[str, str] = {}  # still serving until their endpoint goes, as on a kubelet
        for p in sorted(pods["items"], key=lambda p: p["metadata"].get("creationTimestamp", "")):
            revision = (p["metadata"].get("labels") or {}).get(REVISION_LABEL)
            if revision is None:
                continue
            if p["metadata"].get("deletionTimestamp"):
                if p["metadata"]["name"] in self._urls:
                    terminating[p["metadata"]["name"]] = self._urls[p["metadata"]["name"]]
                continue
            self.first_revision = self.first_revision or revision
            pool = self.first if revision == self.first_revision else self.later
            i = used.get(id(pool), 0)
            used[id(pool)] = i + 1
            urls[p["metadata"]["name"]] = pool[i % len(pool)]
        write_override(self.path, [f"{self.namespace}/{self.name}/{pod}={url}" for pod, url in urls.items()])
        eps = self.cp.endpoint_ready(self.namespace, f"{self.name}-engine")
        engines = {**terminating, **urls}
        with self._lock:
            self._urls = engines
            self._ready = [engines[pod] for pod, ready in eps.items() if ready and pod in engines]
        if self.sampling:
            self.ready_counts.append(sum(eps.values()))

    def ready_urls(self) -> list[str]:
        """The engines behind the ready endpoints now: where the Service would send a request."""
        with self._lock:
            return list(self._ready)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)

    def trouble(self) -> str | None:
        """Why the samples do not show the Service served throughout (None: they do)."""
        if self.error is not None:
            return f"the mapper failed: {self.error!r}"
        if not self.ready_counts:
            return "the EndpointSlice was never sampled"
        if min(self.ready_counts) < 1:
            return f"a sample without a ready endpoint: {self.ready_counts}"
        return None
