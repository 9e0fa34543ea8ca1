#!/usr/bin/env bash
# Build prometheus-adapter (sigs.k8s.io/prometheus-adapter, the custom.metrics.k8s.io server the HPA path
# of spec.autoscaling uses) from the Go module proxy with the machine's Go toolchain, cached by version
# outside the repository: ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/prometheus-adapter-<version>/bin/adapter.
# Skipped when present. Nothing here is committed; see docs/operations.md (Autoscaling).
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/prometheus-adapter-${PROMETHEUS_ADAPTER_VERSION}"
BIN="${ROOT}/bin"

exit_if_built "${BIN}/adapter"
need_go prometheus-adapter
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
