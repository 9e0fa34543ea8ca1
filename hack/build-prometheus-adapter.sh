#!/usr/bin/env bash
# Build prometheus-adapter (sigs.k8s.io/prometheus-adapter, the custom.metrics.k8s.io server the HPA path
# of spec.autoscaling uses) from the Go module proxy with the machine's Go toolchain, cached by version
# outside the repository: ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/prometheus-adapter-<version>/bin/adapter.
# Skipped when present. Nothing here is committed; see docs/operations.md (Autoscaling).
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/versions.env
source "${HACK_DIR}/versions.env"

CACHE="${SERVEDMODEL_CACHE:-${HOME}/.cache/servedmodel}"
ROOT="${CACHE}/prometheus-adapter-${PROMETHEUS_ADAPTER_VERSION}"
BIN="${ROOT}/bin"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod"

log() { printf '[build-prometheus-adapter] %s\n' "$*" >&2; }

if [[ -x "${BIN}/adapter" ]]; then
  log "present: ${BIN}/adapter (delete it to rebuild)"
  exit 0
fi
command -v go >/dev/null || { log "no Go toolchain on PATH: cannot build prometheus-adapter"; exit 1; }
mkdir -p "${BIN}"
t0=$(date +%s)
log "Go $(go env GOVERSION); building sigs.k8s.io/prometheus-adapter@${PROMETHEUS_ADAPTER_VERSION} into ${BIN}"
# A throwaway module rather than `go install pkg@version`: install looks up the module's deprecation
# through the proxy's version list, which the proxy refuses for this module (403).
WORK="${ROOT}/work"
rm -rf "${WORK}" && mkdir -p "${WORK}" && cd "${WORK}"
go mod init servedmodel.local/adapterbuild >/dev/null 2>&1
go get "sigs.k8s.io/prometheus-adapter@${PROMETHEUS_ADAPTER_VERSION}"
go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w" -o "${BIN}/adapter.tmp" sigs.k8s.io/prometheus-adapter/cmd/adapter
mv "${BIN}/adapter.tmp" "${BIN}/adapter"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) go: $(go env GOVERSION) cores: $(nproc) adapter: $(($(date +%s) - t0))s" \
  >>"${ROOT}/build-times.txt"
log "built in $(($(date +%s) - t0))s"
