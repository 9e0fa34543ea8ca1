"""The informer's reflector loop against a scripted API (the real one: tests/cluster/test_faults.py):
synced only after the first list, a 410 relists and prunes, any other error is retried (never ends the
loop), a stream the server ends is resumed from the last resourceVersion (bookmarks move it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from servedmodel.k8s import ApiError, Cache, GoneError, UnreachableError
from servedmodel.k8s.informer import Informer, Watched

WATCHED = Watched("inference.servedmodel.io/v1alpha1", "servedmodels", "ServedModel")


def sm(name: str, uid: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "a", "uid": uid, "resourceVersion": str(rv)}}


class ScriptedApi:
    """list_at answers `lists` in turn; each watch call plays the next script: a list of events, then
    an exception to raise (or None: the server ends the stream)."""

    def __init__(self, lists: list[tuple[list[dict[str, Any]], str]], watches: list[Any]) -> None:
        self.lists, self.watches = lists, watches
        self.list_calls = 0
        self.watch_from: list[str] = []

    async def list_at(self, *_: Any, **__: Any) -> tuple[list[dict[str, Any]], str]:
        self.list_calls += 1
        answer = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def watch(self, *_: Any, resource_version: str, **__: Any) -> AsyncIterator[tuple[str, Any]]:
        self.watch_from.append(resource_version)
        if not self.watches:
            await asyncio.sleep(3600)
        events, error = self.watches.pop(0)
        for e in events:
            yield e
        if error is not None:
            raise error


def informer(api: ScriptedApi, cache: Cache, seen: list[tuple[str, str]]) -> Informer:
    def handler(type_: str, old: Any, new: Any) -> None:
        obj = new if new is not None else old
        seen.append((type_, obj["metadata"]["name"]))

    return Informer(api, WATCHED, cache, handler, backoff_base_s=0.001, backoff_cap_s=0.002)  # type: ignore[arg-type]


async def run_until(inf: Informer, done: Any) -> None:
    task = asyncio.create_task(inf.run())
    try:
        for _ in range(1000):
            if done():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("condition not reached")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_410_relists_and_prunes_what_the_list_lacks() -> None:
    api = ScriptedApi(
        lists=[([sm("a", "1", 5), sm("b", "2", 6)], "10"), ([sm("a", "1", 5)], "30")],
        watches=[([("MODIFIED", sm("a", "1", 12))], GoneError(410, "Expired", "too old resource version"))],
    )
    cache, seen = Cache(), []
    inf = informer(api, cache, seen)
    await run_until(inf, lambda: api.list_calls >= 2 and len(api.watch_from) >= 2)
    assert cache.keys("ServedModel") == [("a", "a")]
    assert ("DELETED", "b") in seen
    assert inf.relists == 2


async def test_errors_are_retried_forever_and_resume_from_the_last_version() -> None:
    errors = [([], UnreachableError(0, "ConnectError", "refused")) for _ in range(5)]
    api = ScriptedApi(
        lists=[([sm("a", "1", 5)], "10")],
        watches=[
            ([("BOOKMARK", {"metadata": {"resourceVersion": "15"}})], ApiError(500, "InternalError", "etcd")),
            *errors,
            ([("ADDED", sm("c", "3", 20))], None),
        ],
    )
    cache, seen = Cache(), []
    inf = informer(api, cache, seen)
    await run_until(inf, lambda: cache.get("ServedModel", "a", "c") is not None)
    assert api.list_calls == 1  # no relist for errors that are not 410
    assert api.watch_from[0] == "10"
    assert api.watch_from[1:7] == ["15"] * 6  # the bookmark's version, every retry
    assert set(api.watch_from[7:]) <= {"20"}  # the stream ended: resumed after its last event
    assert inf.errors == 6


async def test_synced_only_after_the_first_list() -> None:
    api = ScriptedApi(lists=[UnreachableError(0, "ConnectError", "refused"), ([], "1")], watches=[])  # type: ignore[list-item]
    inf = informer(api, Cache(), [])
    task = asyncio.create_task(inf.run())
    try:
        assert not inf.synced.is_set()
        await asyncio.wait_for(inf.synced.wait(), timeout=5.0)
        assert api.list_calls == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
