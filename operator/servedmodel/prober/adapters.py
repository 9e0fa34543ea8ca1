"""spec.adapters on every probed engine pod: loaded, unloaded, and each one's request path probed.

For each pod the cycle probed and found serving, after its own probe: GET /v1/models, then
- unload what is listed as an adapter (a card with a `parent`) but not declared (removed from the spec);
- load what is declared but not listed, and reload in place what is listed from another path (the
  source changed): a replica that restarted lists nothing and gets every adapter again;
- probe each declared adapter that is now listed: the probe's own request path (probe/client.run_probe)
  with `model: <adapter>`, one adapter after the other, without the limits check (that is the engine's,
  proven by the base model's probe), light as the base model's probe is (a PathMemo per pod and adapter:
  the full path on the first cycle, after a (re)load or a restart, and every FULL_PATH_EVERY cycles; the
  timed chat alone between them).

What a load refusal says (vLLM's error body: a missing path 404, a rank over --max-lora-rank 500 "LoRA
rank 32 is greater than max_lora_rank 16.") becomes that adapter's reason and message; the base model's
probe, Serving and readiness gate are not touched by it. compose_adapters (pure) turns the pods' results
into status.probe.adapters, adaptersServing ("serving/declared", the Adapters column) and the
AdaptersServing condition, which names each adapter that does not serve and why.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import httpx

from servedmodel.api.adapters import AdapterPod, AdapterProbe, AdapterSpec
from servedmodel.api.base import ConditionStatus
from servedmodel.api.conditions import ADAPTERS_SERVING, transition
from servedmodel.api.probe import ProbeStatus
from servedmodel.api.spec import ServedModelSpec
from servedmodel.probe import errors
from servedmodel.probe.client import PathMemo, ProbeOutcome, run_probe
from servedmodel.probe.compose import AdapterShare
from servedmodel.probe.endpoints import resolve_override
from servedmodel.probe.errors import ProbeFailure
from servedmodel.probe.loop import ProbeLoop
from servedmodel.probe.replicas import PodResult

from .sources import Sources

log = logging.getLogger(__name__)

ADAPTER_LOAD_FAILED: Final = "AdapterLoadFailed"  # the engine refused to load it (its words in the message)
ADAPTER_NOT_FOUND: Final = "AdapterNotFound"  # the engine found no adapter at its source (vLLM's 404)
ADAPTER_NOT_LOADED: Final = "AdapterNotLoaded"  # not loaded on any pod yet (no pod probed it)
ALL_ADAPTERS_SERVING: Final = "AllAdaptersServing"
ADAPTERS_NOT_SERVING: Final = "AdaptersNotServing"
MODELS_UNREADABLE: Final = "ModelsUnreadable"  # GET /v1/models of the pod failed: nothing synced
MESSAGE_MAX: Final = 300


@dataclass(frozen=True)
class Target:
    """A pod to sync: its name, the URL it is probed at, and its incarnation (uid and restarts)."""

    name: str
    url: str
    incarnation: str = ""


@dataclass
class AdapterOnPod:
    """One declared adapter on one pod after the sync: loaded there, its probe, or why it is not."""

    name: str
    loaded: bool = False
    outcome: ProbeOutcome | None = None
    reason: str = ""  # why it is not loaded (a load refusal), "" when loaded
    message: str = ""

    @property
    def serving(self) -> bool:
        return self.loaded and self.outcome is not None and self.outcome.ok

    @property
    def why(self) -> str:
        """Its reason: Serving, the load refusal's, or its probe's failure reason."""
        if not self.loaded:
            return self.reason
        if self.outcome is None or self.outcome.failure is None:
            return errors.SERVING
        return self.outcome.failure.reason


@dataclass
class PodAdapters:
    """What the sync of one pod did and found."""

    pod: str
    adapters: dict[str, AdapterOnPod] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)  # loads this cycle made
    unloaded: list[str] = field(default_factory=list)  # unloads this cycle made
    requests: int = 0  # HTTP requests the sync itself sent (models, loads, unloads; not the probes)


def _error_text(resp: httpx.Response) -> str:
    """`<status> <type>: <message>` of vLLM's error body, or the status and the start of the body."""
    try:
        err = resp.json().get("error") or {}
        return f"{resp.status_code} {err.get('type')}: {err.get('message')}"[:MESSAGE_MAX]
    except (ValueError, AttributeError):
        return f"{resp.status_code}: {resp.text[:200]}"


def listed_adapters(models: Mapping[str, Any]) -> dict[str, str]:
    """Adapter name -> its root (the path it was loaded from), from a /v1/models answer: the cards with
    a parent (vLLM's LoRA cards; a base model's parent is null)."""
    out: dict[str, str] = {}
    for card in models.get("data") or []:
        if isinstance(card, Mapping) and card.get("parent") and card.get("id"):
            out[str(card["id"])] = str(card.get("root") or "")
    return out


async def sync_pod(
    http: httpx.AsyncClient,
    base_url: str,
    spec: ServedModelSpec,
    pod: str,
    *,
    api_key: str | None = None,
    memos: dict[str, PathMemo] | None = None,
    incarnation: str = "",
) -> PodAdapters:
    """Bring one pod's adapters to spec.adapters and probe each loaded one (see the module docstring).
    Never raises for the engine's answers; a transport error leaves the adapters unprobed here. `memos`
    ("<pod>/<adapter>" -> PathMemo) makes the adapters' probes light where they can be (None: full)."""
    result = PodAdapters(pod)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    declared: dict[str, AdapterSpec] = {a.name: a for a in spec.adapters}
    try:
        resp = await http.get(f"{base_url}/v1/models", headers=headers)
        result.requests += 1
        if resp.status_code != 200:
            raise ProbeFailure(MODELS_UNREADABLE, f"GET /v1/models: {_error_text(resp)}")
        listed = listed_adapters(resp.json())
    except (httpx.HTTPError, ValueError, ProbeFailure) as exc:
        message = exc.message if isinstance(exc, ProbeFailure) else f"GET /v1/models: {exc!r}"[:MESSAGE_MAX]
        for name in declared:
            result.adapters[name] = AdapterOnPod(name, reason=MODELS_UNREADABLE, message=message)
        return result
    for name in sorted(set(listed) - set(declared)):
        try:
            resp = await http.post(
                f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers
            )
            result.requests += 1
            if resp.status_code == 200:
                result.unloaded.append(name)
            else:
                log.warning("unloading adapter %s from pod %s: %s", name, pod, _error_text(resp))
        except httpx.HTTPError as exc:
            log.warning("unloading adapter %s from pod %s: %r", name, pod, exc)
    for name, adapter in declared.items():
        entry = result.adapters[name] = AdapterOnPod(name)
        path = adapter.lora_path
        if listed.get(name) == path:
            entry.loaded = True
            continue
        body = {"lora_name": name, "lora_path": path, "load_inplace": name in listed}
        try:
            resp = await http.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=headers)
            result.requests += 1
        except httpx.HTTPError as exc:
            entry.reason, entry.message = ADAPTER_LOAD_FAILED, f"POST /v1/load_lora_adapter: {exc!r}"
            continue
        if resp.status_code == 200:
            entry.loaded = True
            result.loaded.append(name)
        else:
            entry.reason = ADAPTER_NOT_FOUND if resp.status_code == 404 else ADAPTER_LOAD_FAILED
            entry.message = f"loading {path}: {_error_text(resp)}"
    # the adapters' own request paths, one after the other (the limits check is the engine's, not theirs)
    probe_spec = spec.probe.model_copy(update={"check_limits": False})
    target = resolve_override(base_url)
    probe_key = f"{incarnation} {spec.resolved_served_model_name} {probe_spec.model_dump_json()}"
    for name, entry in result.adapters.items():
        if not entry.loaded:
            continue
        memo = None
        if memos is not None:
            slot, key = f"{pod}/{name}", f"{declared[name].lora_path} {probe_key}"
            memo = memos.get(slot)
            if memo is None or memo.key != key or name in result.loaded:  # new, or (re)loaded: full path
                memo = memos[slot] = PathMemo(key)
        entry.outcome = await run_probe(http, target, probe_spec, model=name, api_key=api_key, memo=memo)
    return result


async def sync_pods(
    client: httpx.AsyncClient,
    sources: Sources,
    probe_loop: ProbeLoop,
    key: tuple[str, str],
    spec: ServedModelSpec,
    targets: Sequence[Target],
    probed: Sequence[PodResult],
    memos: dict[str, PathMemo] | None = None,
) -> dict[str, PodAdapters] | None:
    """sync_pod on every probed pod whose own probe served, side by side on the probe loop; None when
    the engine's API key cannot be read (nothing is sent then). `memos` keeps the adapters' PathMemos
    across cycles (those of pods not probed now are dropped)."""
    serving = {r.name for r in probed if r.serving}
    urls = [t for t in targets if t.name in serving]
    if memos is not None:
        probed_now = {t.name for t in targets}
        for slot in [s for s in memos if s.split("/", 1)[0] not in probed_now]:
            del memos[slot]
    async with client as http:
        try:
            api_key = await sources.api_key(key, spec)
        except ProbeFailure:
            sources.redacted(key)
            return None
        results = await asyncio.gather(
            *(
                probe_loop.submit(
                    sync_pod(
                        http,
                        resolve_override(t.url).base_url,
                        spec,
                        t.name,
                        api_key=api_key,
                        memos=memos,
                        incarnation=t.incarnation,
                    )
                )
                for t in urls
            )
        )
    outcomes = [e.outcome for r in results for e in r.adapters.values() if e.outcome is not None]
    scrubbed = iter(sources.redacted(key, *outcomes))
    for r in results:
        for e in r.adapters.values():
            if e.outcome is not None:
                e.outcome = next(scrubbed)
    for r in results:
        if r.loaded or r.unloaded:
            log.info("adapters on pod %s: loaded %s, unloaded %s", r.pod, r.loaded, r.unloaded)
    return {r.pod: r for r in results}


def started_failing(previous: ProbeStatus | None, new: ProbeStatus) -> bool:
    """Whether an adapter's own verdict turned False in this cycle (the Warning Event's moment): one that
    was not failing before is now, whatever the others did meanwhile."""
    before = (
        {a.name for a in (previous.adapters or []) if a.serving == "False"} if previous is not None else set()
    )
    return any(a.serving == "False" and a.name not in before for a in new.adapters or [])


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _pod_entry(pod: str, entry: AdapterOnPod) -> AdapterPod:
    figures = entry.outcome.figures if entry.outcome is not None and entry.serving else None
    return AdapterPod(
        name=pod,
        serving="True" if entry.serving else "False",
        reason=entry.why,
        ttft_ms=_round(figures.ttft_ms) if figures is not None else None,
        tpot_ms=_round(figures.tpot_ms) if figures is not None else None,
    )


def compose_adapters(
    spec: ServedModelSpec,
    synced: Mapping[str, PodAdapters] | None,
    previous: ProbeStatus | None,
    eligible: Sequence[str],
    conditions: Any,
    generation: int | None,
    now: datetime,
) -> AdapterShare | None:
    """status.probe.adapters, adaptersServing and AdaptersServing from this cycle's syncs; pods not synced
    this cycle (not probed, or not serving) keep their entries while they can be probed. None without
    spec.adapters (the fields and the condition leave the status)."""
    if not spec.adapters:
        return None
    old = {a.name: a for a in (previous.adapters or [])} if previous is not None else {}
    synced = synced or {}
    entries: list[AdapterProbe] = []
    for adapter in spec.adapters:
        before = old.get(adapter.name)
        kept = {
            p.name: p
            for p in (before.pods or [] if before is not None else [])
            if p.name in eligible and p.name not in synced
        }
        serving: ConditionStatus
        # (reason, what the engine or the probe said) -> the pods that said it, so one refusal on every
        # replica reads once
        failures: dict[tuple[str, str], list[str]] = {}
        for pod, result in synced.items():
            entry = result.adapters.get(adapter.name)
            if entry is None:
                continue
            if entry.loaded:
                kept[pod] = _pod_entry(pod, entry)
                if not entry.serving and entry.outcome is not None and entry.outcome.failure is not None:
                    failures.setdefault((entry.why, entry.outcome.failure.message[:MESSAGE_MAX]), []).append(
                        pod
                    )
            else:
                failures.setdefault((entry.why, entry.message[:MESSAGE_MAX]), []).append(pod)
        pods = [kept[n] for n in sorted(kept)]
        serving_pods = [p for p in pods if p.serving == "True"]
        if failures:
            serving, reason = "False", next(iter(failures))[0]
            message = "; ".join(f"{why} on {', '.join(on)}: {said}" for (why, said), on in failures.items())
        elif pods and len(serving_pods) == len(pods):
            serving, reason = "True", errors.SERVING
            message = f"a real chat completion on {len(pods)} pod(s)"
        elif pods:
            serving, reason = "False", next(p.reason for p in pods if p.serving != "True")
            message = "its probe failed on " + ", ".join(p.name for p in pods if p.serving != "True")
        elif before is not None and not synced:
            entries.append(before)  # nothing synced this cycle: as it was
            continue
        else:
            serving, reason, message = "Unknown", ADAPTER_NOT_LOADED, "not loaded on any probed pod yet"
        entries.append(
            AdapterProbe(
                name=adapter.name,
                serving=serving,
                reason=reason,
                message=message[:1000],
                loaded=f"{len(pods)}/{len(eligible)}",
                ttft_ms=_median(p.ttft_ms for p in serving_pods),
                tpot_ms=_median(p.tpot_ms for p in serving_pods),
                pods=pods or None,
            )
        )
    serving_count = sum(1 for e in entries if e.serving == "True")
    not_serving = [e for e in entries if e.serving != "True"]
    status: ConditionStatus
    if not not_serving:
        status, reason = "True", ALL_ADAPTERS_SERVING
        message = f"all {len(entries)} adapter(s) served a real chat completion"
    else:
        status = "False" if any(e.serving == "False" for e in not_serving) else "Unknown"
        failed = [e for e in not_serving if e.serving == "False"]
        reason = failed[0].reason if len(failed) == 1 else ADAPTERS_NOT_SERVING
        if not failed:
            reason = ADAPTER_NOT_LOADED
        message = "; ".join(f"{e.name}: {e.message}" for e in not_serving)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = transition(
        conditions,
        ADAPTERS_SERVING,
        status,
        reason,
        message,
        generation=generation,
        now=stamp,
    )
    return AdapterShare(entries, f"{serving_count}/{len(entries)}", condition)
