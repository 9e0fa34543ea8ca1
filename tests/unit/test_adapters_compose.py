"""prober/adapters.compose_adapters (pure): per adapter the pods that have it and its own verdict, entries
of pods not synced this cycle kept while those pods can be probed, one refusal on every replica said once,
adaptersServing and the AdaptersServing condition."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from servedmodel.api import ServedModelSpec
from servedmodel.api.probe import ProbeStatus
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.errors import ProbeFailure
from servedmodel.probe.sse import ClientFigures
from servedmodel.prober.adapters import AdapterOnPod, PodAdapters, compose_adapters, started_failing

NOW = datetime(2026, 12, 4, 17, 0, tzinfo=UTC)


def spec(*names: str) -> ServedModelSpec:
    adapters = [{"name": n, "source": f"hf://org/{n}"} for n in names]
    return ServedModelSpec.model_validate({"model": "Qwen/Qwen2.5-7B-Instruct", "adapters": adapters})


def served(ttft: float) -> ProbeOutcome:
    figures = ClientFigures(
        headers_ms=1.0, ttft_ms=ttft, tpot_ms=2.0, itl_ms=[], itl_p50_ms=None, itl_p95_ms=None,
        e2e_ms=ttft + 30, completion_tokens=16,
    )  # fmt: skip
    return ProbeOutcome(endpoint="http://x", started=NOW, ended=NOW, figures=figures)


def pod(name: str, **adapters: AdapterOnPod) -> PodAdapters:
    return PodAdapters(name, adapters={a.name: a for a in adapters.values()})


def refused(name: str) -> AdapterOnPod:
    return AdapterOnPod(name, reason="AdapterLoadFailed", message="loading x: 500 InternalServerError: rank")


def compose(
    s: ServedModelSpec, synced: Any, previous: ProbeStatus | None = None, eligible: Any = None
) -> Any:
    share = compose_adapters(s, synced, previous, eligible or ["a", "b"], [], 3, NOW)
    assert share is not None
    return share


def test_every_pod_serves_every_adapter() -> None:
    synced = {
        p: pod(p, sql=AdapterOnPod("sql", loaded=True, outcome=served(t)))
        for p, t in (("a", 10.0), ("b", 20.0))
    }
    share = compose(spec("sql"), synced)
    (sql,) = share.entries
    assert (sql.serving, sql.reason, sql.loaded, sql.ttft_ms) == ("True", "Serving", "2/2", 15.0)
    assert [p.name for p in sql.pods] == ["a", "b"]
    assert share.serving == "1/1"
    assert (share.condition["status"], share.condition["reason"]) == ("True", "AllAdaptersServing")


def test_one_refusal_on_every_replica_reads_once_and_the_others_serve() -> None:
    synced = {
        p: pod(p, sql=AdapterOnPod("sql", loaded=True, outcome=served(10.0)), wide=refused("wide"))
        for p in ("a", "b")
    }
    share = compose(spec("sql", "wide"), synced)
    entries = {e.name: e for e in share.entries}
    wide = entries["wide"]
    assert (wide.serving, wide.reason, wide.loaded, wide.pods) == ("False", "AdapterLoadFailed", "0/2", None)
    assert wide.message == "AdapterLoadFailed on a, b: loading x: 500 InternalServerError: rank"
    assert entries["sql"].serving == "True"
    assert share.serving == "1/2"
    cond = share.condition
    assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed")
    assert cond["message"] == "wide: AdapterLoadFailed on a, b: loading x: 500 InternalServerError: rank"
    assert (cond["observedGeneration"], cond["lastTransitionTime"]) == (3, "2026-12-04T17:00:00Z")


def test_an_adapter_whose_probe_fails_names_the_pod_and_reason() -> None:
    failed = ProbeOutcome(
        endpoint="http://x",
        started=NOW,
        ended=NOW,
        failure=ProbeFailure("FirstByteTimeout", "no byte in 5 s"),
    )
    synced = {
        "a": pod("a", sql=AdapterOnPod("sql", loaded=True, outcome=served(10.0))),
        "b": pod("b", sql=AdapterOnPod("sql", loaded=True, outcome=failed)),
    }
    (sql,) = compose(spec("sql"), synced).entries
    assert (sql.serving, sql.reason, sql.loaded) == ("False", "FirstByteTimeout", "2/2")
    assert sql.message == "FirstByteTimeout on b: no byte in 5 s"
    assert [(p.name, p.serving) for p in sql.pods] == [("a", "True"), ("b", "False")]
    assert sql.ttft_ms == 10.0  # the serving pods' median


def test_pods_not_synced_keep_their_entries_while_they_can_be_probed() -> None:
    first = compose(
        spec("sql"), {p: pod(p, sql=AdapterOnPod("sql", loaded=True, outcome=served(9.0))) for p in "ab"}
    )
    previous = ProbeStatus(adapters=first.entries)
    # only b synced this cycle; a is still eligible (rotation), c is gone
    later = compose(
        spec("sql"),
        {"b": pod("b", sql=AdapterOnPod("sql", loaded=True, outcome=served(11.0)))},
        previous,
        eligible=["a", "b"],
    )
    (sql,) = later.entries
    assert [(p.name, p.ttft_ms) for p in sql.pods] == [("a", 9.0), ("b", 11.0)]
    # no pod synced at all (none served): the adapters' share as it was
    same = compose(spec("sql"), {}, ProbeStatus(adapters=later.entries))
    assert same.entries == later.entries
    # not loaded anywhere yet, nothing before: Unknown
    (new,) = compose(spec("sql"), {}).entries
    assert (new.serving, new.reason) == ("Unknown", "AdapterNotLoaded")


def test_no_adapters_no_share() -> None:
    assert compose_adapters(spec(), {}, None, ["a"], [], 1, NOW) is None


def test_an_event_when_an_adapter_starts_failing_even_if_another_already_failed() -> None:
    """started_failing: the Warning Event's moment is an adapter turning False, not the condition."""

    def status(sql: AdapterOnPod, wide: AdapterOnPod) -> ProbeStatus:
        synced = {p: pod(p, sql=sql, wide=wide) for p in "ab"}
        return ProbeStatus(adapters=compose(spec("sql", "wide"), synced).entries)

    def up(name: str) -> AdapterOnPod:
        return AdapterOnPod(name, loaded=True, outcome=served(9.0))

    healthy = status(up("sql"), up("wide"))
    one_down = status(up("sql"), refused("wide"))
    both_down = status(refused("sql"), refused("wide"))
    assert started_failing(None, one_down)
    assert started_failing(healthy, one_down)
    assert not started_failing(one_down, one_down)  # still the same one: said already
    assert started_failing(one_down, both_down)  # sql too now, though the condition was False already
    assert not started_failing(both_down, healthy)
