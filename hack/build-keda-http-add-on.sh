#!/usr/bin/env bash
# Build KEDA's HTTP add-on (github.com/kedacore/http-add-on): the interceptor (holds a request to a model at
# zero, forwards once the Service has ready endpoints) and the external scaler (the external-push trigger
# KEDA asks IsActive), from the Go module proxy, cached by version outside the repository:
# ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/keda-http-add-on-<version>/bin/{interceptor,scaler}.
# Its own operator is not built: our ScaledObject carries the trigger (docs/operations.md).
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/keda-http-add-on-${KEDA_HTTP_ADD_ON_VERSION}"
BIN="${ROOT}/bin"

exit_if_built "${BIN}/scaler"
need_go keda-http-add-on
mkdir -p "${BIN}"
t0=$(date +%s)
log "Go $(go env GOVERSION); building github.com/kedacore/http-add-on@${KEDA_HTTP_ADD_ON_VERSION} into ${BIN}"
WORK="${ROOT}/work"
rm -rf "${WORK}" && mkdir -p "${WORK}" && cd "${WORK}"
go mod init servedmodel.local/httpaddonbuild >/dev/null 2>&1
go get "github.com/kedacore/http-add-on@${KEDA_HTTP_ADD_ON_VERSION}"
for cmd in interceptor scaler; do
  go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w" -o "${BIN}/${cmd}.tmp" \
    "github.com/kedacore/http-add-on/${cmd}"
  mv "${BIN}/${cmd}.tmp" "${BIN}/${cmd}"
done
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) go: $(go env GOVERSION) cores: $(nproc) interceptor+scaler: $(($(date +%s) - t0))s" \
  >>"${ROOT}/build-times.txt"
log "built in $(($(date +%s) - t0))s"
