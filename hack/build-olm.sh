#!/usr/bin/env bash
# Build Operator Lifecycle Manager's two operators (github.com/operator-framework/operator-lifecycle-manager
# cmd/olm: OperatorGroups and ClusterServiceVersions, the install strategy's Deployments and RBAC; cmd/catalog:
# CatalogSources, Subscriptions, the resolver and InstallPlans) and operator-registry's opm (cmd/opm: `opm
# serve` of a file-based catalog over gRPC) from the Go module proxy with the machine's Go toolchain, and copy
# OLM's CRDs (deploy/chart/crds) next to them, cached by version outside the repository:
# ${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/olm-<version>/ (bin/olm, bin/catalog, bin/opm, crds/).
# Skipped when present. opm is the version OLM's go.mod requires. Upstream builds all three with
# CGO_ENABLED=0 and the tags below (OLM's Makefile GO_BUILD_TAGS, operator-registry's TAGS); opm's sqlite
# index commands need cgo and are not used here (`opm serve` reads a file-based catalog). Nothing here is
# committed; see docs/control-plane.md (OLM).
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/olm-${OLM_VERSION}"
BIN="${ROOT}/bin"
OLM_MODULE=github.com/operator-framework/operator-lifecycle-manager
REGISTRY_MODULE=github.com/operator-framework/operator-registry

exit_if_built "${BIN}/opm"
need_go olm
mkdir -p "${BIN}"
t0=$(date +%s)
log "Go $(go env GOVERSION); building ${OLM_MODULE}@${OLM_VERSION} (olm, catalog) and opm into ${BIN}"
# A throwaway module (the proxy refuses these modules' version lists; exact versions resolve).
WORK="${ROOT}/work"
rm -rf "${WORK}" && mkdir -p "${WORK}" && cd "${WORK}"
go mod init servedmodel.local/olmbuild >/dev/null 2>&1
go get "${OLM_MODULE}@${OLM_VERSION}"
REGISTRY_VERSION="$(go list -m -f '{{.Version}}' "${REGISTRY_MODULE}")"
MOD="$(go list -m -f '{{.Dir}}' "${OLM_MODULE}")"
rm -rf "${ROOT}/crds" && mkdir -p "${ROOT}/crds"
cp "${MOD}"/deploy/chart/crds/*.yaml "${ROOT}/crds/"
chmod -R u+w "${ROOT}/crds"
version="-X ${OLM_MODULE}/pkg/version.OLMVersion=${OLM_VERSION}"
for cmd in olm catalog; do
  t1=$(date +%s)
  go build -p "${GO_BUILD_P:-2}" -trimpath -tags json1 -ldflags "-s -w ${version}" \
    -o "${BIN}/${cmd}.tmp" "${OLM_MODULE}/cmd/${cmd}"
  mv "${BIN}/${cmd}.tmp" "${BIN}/${cmd}"
  log "${cmd}: $(($(date +%s) - t1))s"
done
t1=$(date +%s)
go build -p "${GO_BUILD_P:-2}" -trimpath -tags json1,containers_image_openpgp \
  -ldflags "-s -w -X ${REGISTRY_MODULE}/cmd/opm/version.opmVersion=${REGISTRY_VERSION}" \
  -o "${BIN}/opm.tmp" "${REGISTRY_MODULE}/cmd/opm"
mv "${BIN}/opm.tmp" "${BIN}/opm"
log "opm ${REGISTRY_VERSION}: $(($(date +%s) - t1))s"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) go: $(go env GOVERSION) cores: $(nproc) olm+catalog+opm: $(($(date +%s) - t0))s" \
  >>"${ROOT}/build-times.txt"
log "built in $(($(date +%s) - t0))s"
