"""One way to read the cluster (controller-runtime's client.Reader): from the watch-fed cache where an
informer feeds the kind, from the API server where none does.

The rule lives here, not at each call site:

- a kind an informer feeds (`Cache.tracks`) is read from the cache, and its absence there is the
  answer — every object of it the operator reads carries the label its watch selects (the children's
  ``app.kubernetes.io/managed-by``), and nothing runs before the informers synced (handlers/startup.py);
- a kind in `PARTIAL` is watched only in part (ConfigMaps: only the labelled chat templates), so a miss
  in the cache falls through to a GET;
- any other kind (a Route on OpenShift) is read from the API server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from servedmodel.api.base import Obj

from .cache import Cache
from .client import KubeClient

# Kinds whose watch selects only some of the objects the operator may read.
PARTIAL: Final = frozenset({"ConfigMap"})


class Reader:
    """`cache` None: everything from the API server (a probe scheduler driven without informers)."""

    def __init__(self, client: KubeClient, cache: Cache | None) -> None:
        self.client, self.cache = client, cache

    async def get(self, api_version: str, plural: str, namespace: str, name: str) -> Obj | None:
        if self.cache is None:
            return await self.client.get(api_version, plural, namespace, name)
        kind = self.client.resource(api_version, plural).kind
        if self.cache.tracks(kind):
            found = self.cache.get(kind, namespace, name)
            if found is not None or kind not in PARTIAL:
                return found
        return await self.client.get(api_version, plural, namespace, name)

    async def list(
        self, api_version: str, plural: str, namespace: str, labels: Mapping[str, str]
    ) -> list[Obj]:
        """Objects of one namespace carrying every label in `labels`."""
        if self.cache is not None:
            kind = self.client.resource(api_version, plural).kind
            if self.cache.tracks(kind) and kind not in PARTIAL:
                return self.cache.list(kind, namespace, labels=dict(labels))
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        return await self.client.list(api_version, plural, namespace, label_selector=selector)
