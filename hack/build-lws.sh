#!/usr/bin/env bash
# Build the LeaderWorkerSet controller manager (sigs.k8s.io/lws cmd/main.go: the LWS and pod reconcilers
# and its webhooks, the multi-node path of spec.workers) from the Go module proxy with the machine's Go
# toolchain, and copy its CRD (config/crd/bases) and webhook configurations (config/webhook) next to it,
# cached by version outside the repository: ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/lws-<version>/
# (bin/lws-controller, crd/, webhook/). Skipped when present. Nothing here is committed; see
# docs/operations.md (Multi-node groups).
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/lws-${LWS_VERSION}"
BIN="${ROOT}/bin"

exit_if_built "${BIN}/lws-controller"
need_go lws
mkdir -p "${BIN}"
t0=$(date +%s)
log "Go $(go env GOVERSION); building sigs.k8s.io/lws@${LWS_VERSION} into ${BIN}"
# A throwaway module (not `go install pkg@version`): the proxy refuses this module's version list.
WORK="${ROOT}/work"
rm -rf "${WORK}" && mkdir -p "${WORK}" && cd "${WORK}"
go mod init servedmodel.local/lwsbuild >/dev/null 2>&1
go get "sigs.k8s.io/lws@${LWS_VERSION}"
MOD="$(go list -m -f '{{.Dir}}' sigs.k8s.io/lws)"
rm -rf "${ROOT}/crd" "${ROOT}/webhook" && mkdir -p "${ROOT}/crd" "${ROOT}/webhook"
cp "${MOD}"/config/crd/bases/*.yaml "${ROOT}/crd/"
cp "${MOD}/config/webhook/manifests.yaml" "${ROOT}/webhook/manifests.yaml"
chmod -R u+w "${ROOT}/crd" "${ROOT}/webhook"
go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w" -o "${BIN}/lws-controller.tmp" sigs.k8s.io/lws/cmd
mv "${BIN}/lws-controller.tmp" "${BIN}/lws-controller"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) go: $(go env GOVERSION) cores: $(nproc) lws-controller: $(($(date +%s) - t0))s" \
  >>"${ROOT}/build-times.txt"
log "built in $(($(date +%s) - t0))s"
