#!/usr/bin/env bash
# Build KEDA's operator (github.com/kedacore/keda/v2 cmd/operator) from the Go module proxy with the
# machine's Go toolchain, cached by version outside the repository:
# ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/keda-<version>/keda-operator. Optional: only
# tests/cluster/test_autoscaling.py's real-KEDA test uses it (it skips without). The module's go.mod has
# replace directives, so `go install pkg@version` cannot build it: the module's own tree is built.
# Cold on 2 busy cores this takes the best part of an hour (KEDA links every scaler's cloud SDK).
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"  # the same pin as hack/olm_tools.py's KEDA CRDs
ROOT="${CACHE}/keda-${KEDA_VERSION}"

exit_if_built "${ROOT}/keda-operator"
need_go "KEDA's operator"
mkdir -p "${ROOT}"
t0=$(date +%s)
src="$(go mod download -json "github.com/kedacore/keda/v2@${KEDA_VERSION}" | jq -r .Dir)"
rm -rf "${ROOT}/src" && cp -r "${src}" "${ROOT}/src" && chmod -R u+w "${ROOT}/src"
cd "${ROOT}/src"
go build -p "${GO_BUILD_P:-1}" -trimpath -ldflags "-s -w" -o "${ROOT}/keda-operator.tmp" ./cmd/operator
mv "${ROOT}/keda-operator.tmp" "${ROOT}/keda-operator"
log "built in $(($(date +%s) - t0))s"
