"""What the dead-code pass (`make deadcode`: vulture over operator/servedmodel) reports that is deliberate.

vulture reads this file as code that uses these names; nothing imports it. Every entry says why it is
used although no line of the package reads it. Anything else vulture reports is dead: remove it.
"""

# ruff: noqa: B018, F821
# The ServedModel API (pydantic): fields written into the CR and its status through model_dump and read
# by people and tools (kubectl, the console, dashboards, autoscalers), never by attribute in this code.
_.observed_generation  # Condition.observedGeneration, status.observedGeneration
_.last_transition_time  # Condition.lastTransitionTime
_.resource_version  # ObjectMeta: parsed, not used
_.creation_timestamp  # ObjectMeta: parsed, not used
_.ready_replicas  # status.readyReplicas
_.inference_ms  # status.probe.server.inferenceMs
_.prompt_tokens_per_second  # status.probe.counters
_.generation_tokens_per_second  # status.probe.counters
_.ttft_p50_ms  # status.probe.window
_.tpot_p50_ms  # status.probe.window
_.e2e_p50_ms  # status.probe.window
_.metrics_pods  # status.probe.metricsPods
_.operator  # spec.tolerations[].operator (Kubernetes' Toleration)
_.effect  # spec.tolerations[].effect
_.toleration_seconds  # spec.tolerations[].tolerationSeconds
_.from_replicas  # status.autoscaling.lastScale
_.to_replicas  # status.autoscaling.lastScale
_.current_replicas  # status.autoscaling
_.desired_replicas  # status.autoscaling (a printer column)
_.adapters_serving  # status.probe.adaptersServing (the Adapters printer column)
_.last_scale  # status.autoscaling
_.scheduled_seconds  # status.startup's stages: read by name (probe/startup.stage_field), not by attribute
_.initialized_seconds  # status.startup
_.image_pulled_seconds  # status.startup
_.container_started_seconds  # status.startup
_.containers_ready_seconds  # status.startup
_.engine_healthy_seconds  # status.startup
_.first_token_seconds  # status.startup
_.p50  # status.startup.p50
_.p95  # status.startup.p95

# Framework hooks: called or read by the library, not by us.
_.ignore_aliases  # PyYAML's Dumper hook (api/crd.py: no anchors in a CRD)
_.progress_storage  # kopf settings (handlers/startup.py)
_.diffbase_storage  # kopf settings
_.server_timeout  # kopf settings
_.client_timeout  # kopf settings
_.request_timeout  # kopf settings
_.worker_limit  # kopf settings
_.idle_timeout  # kopf settings
_.fetch  # kopf's DiffBaseStorage interface (handlers/startup.NoDiffBase), called by kopf
_.store  # kopf's DiffBaseStorage interface
_.build  # kopf's DiffBaseStorage interface
extra_fields  # kopf's DiffBaseStorage.build keyword parameter
essence  # kopf's DiffBaseStorage.store keyword parameter
_.__qualname__  # kopf names a handler by it (handlers/servedmodel.py's per-kind handlers)
exc_type  # the context-manager protocol's __aexit__ parameters (sim/process.py)
tb  # the context-manager protocol's __aexit__ parameters

# Introspection the tests read, deliberate API of the object it belongs to.
_.phase_counts  # WindowDelta: observations per histogram; bench/probe_vs_vllm_bench.py pools windows by it
_.tracked  # ProbeScheduler.tracked(): the ServedModels it probes (tests/probe check it forgets deleted ones)
_.num_prefill_computed  # the simulator's ground truth of prompt tokens computed, recompute after preemption
# included (tests/sim hold the scheduler to vLLM's accounting)

# The operator image name the manifests and the OLM bundle use; tests/ship/test_wiring.py holds them to it.
OPERATOR_IMAGE
# Security (issue 18): a pydantic field validator (OperatorConfig.allowed_targets: a bad entry fails at
# start-up), wsgiref's log hook (the /metrics server logs no request lines), and the count of API reviews
# the /metrics authorizer made, which tests/unit/test_metrics_auth.py reads to see the cache work.
_._parse_targets  # @field_validator, called by pydantic
_.log_message  # wsgiref.simple_server.WSGIRequestHandler.log_message, called by http.server
_.reviews  # MetricsAuthorizer.reviews
# asyncio.Protocol's callbacks, called by the event loop (wire/http11.py's _Wire: one per connection).
_.connection_made
_.data_received
_.eof_received
_.connection_lost
_.pause_writing
_.resume_writing
# http.cookiejar.CookieJar's hooks, called by httpx per answer and request (probe/client.py's _NoCookies).
_.extract_cookies
_.add_cookie_header
