#!/usr/bin/env bash
# Build KEDA's operator (github.com/kedacore/keda/v2/cmd/operator: the ScaledObject controller that does the
# 0 -> 1 activation from an external scaler's IsActive) from the Go module proxy, cached by version outside
# the repository: ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/keda-<version>/bin/keda. It links every
# scaler: the largest build here. KEDA's metrics-apiserver (1 -> N) is not built. See docs/operations.md.
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/keda-${KEDA_VERSION}"
BIN="${ROOT}/bin"

exit_if_built "${BIN}/keda"
need_go keda
mkdir -p "${BIN}"
t0=$(date +%s)
log "Go $(go env GOVERSION); building github.com/kedacore/keda/v2@${KEDA_VERSION} cmd/operator into ${BIN}"
WORK="${ROOT}/work"
rm -rf "${WORK}" && mkdir -p "${WORK}" && cd "${WORK}"
go mod init servedmodel.local/kedabuild >/dev/null 2>&1
go get "github.com/kedacore/keda/v2@${KEDA_VERSION}"
go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w" -o "${BIN}/keda.tmp" github.com/kedacore/keda/v2/cmd/operator
mv "${BIN}/keda.tmp" "${BIN}/keda"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) go: $(go env GOVERSION) cores: $(nproc) keda: $(($(date +%s) - t0))s" \
  >>"${ROOT}/build-times.txt"
log "built in $(($(date +%s) - t0))s"
