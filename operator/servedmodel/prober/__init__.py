"""The prober: the controller that probes every ServedModel's request path (the reconciler is the other).

No kopf here (handlers/prober.py starts and stops it: on the leader, or on every replica with probe
sharding, where `owns` picks this replica's share). One task for all models, not one per object.

- Due times: each ServedModel has its own, spec.probe.interval apart and jittered ±10 %; a model seen
  for the first time is placed at a random point of its first interval (continuing from its last
  status.probe.lastProbeTime after an operator restart), so a thousand ServedModels never fire
  together.
- Concurrency: at most `OperatorConfig.probe_concurrency` cycles run at once; a due model waits for a
  slot, earliest due first. One namespace holds at most its share of the slots: max-min fair shares
  sized from each namespace's demand (prober/shares.py), so a lone tenant gets all it needs, and 16 models
  of one tenant pointed at a listener that never answers leave the other tenants' probes on time. While
  the reconciler has keys waiting for a worker (`yield_to`), at most YIELD_SLOTS cycles run: a thousand
  models created at once are reconciled first and probed as they come. A cycle's requests all fit in
  probe.client.cycle_budget_s.
- The probe's clock: each cycle's requests (door, tokenize, /metrics, the timed streams) run on a
  ProbeLoop (probe/loop.py), an event loop in its own thread that does nothing else, so the main loop's
  watch events, reconciles and status writes do not become "engine latency". The scheduler, Secrets and
  every Kubernetes request stay on the main loop. Both loops' lag is exported
  (servedmodel_event_loop_lag_seconds).
- Backoff: a model whose cycles fail is probed less often (probe/schedule.next_delay, capped at four
  intervals); its backoff is its own and delays no other model.
- One status write per probed cycle (server-side apply of what probe/compose.compose composed:
  status.probe, status.rollout and the probe's conditions, with the probe's field manager), after the
  pods' readiness-gate writes it also composed. lastProbeTime moves every cycle, so every probed cycle
  writes; a cycle that probes nothing (probing off, no engine ready, a repeat of NoReadyEndpoints)
  writes nothing, and none is written after the object got a deletionTimestamp or went away.
- When a write changes the Serving condition, the ServedModel is enqueued in the controller's work queue
  so the reconciler's phase and Degraded follow at once (the probe never writes the phase).
- `stop()` cancels every in-flight cycle and waits for it: nothing is left running or half-written.

Reads go through k8s/reader.Reader: the ServedModel and its pods from the watch-fed cache when one is
given, Secrets (the engine's API key, a Prometheus token) from the API server (no informer feeds them).

Rooms: scheduler.py decides when a cycle runs (ProbeScheduler), cycle.py runs one (its reads, the probes
on the ProbeLoop, the writes), sources.py says what a cycle may send where (Secrets, allow-lists,
redaction), telemetry.py is the prober's own Prometheus series. What the status says is probe/compose.py's,
pure; probe/ is the request-path library all of them use.
"""

from .cycle import CycleResult, containers_ready
from .scheduler import ProbeScheduler, first_due
from .telemetry import ProbeMetrics

__all__ = ["CycleResult", "ProbeMetrics", "ProbeScheduler", "containers_ready", "first_due"]
