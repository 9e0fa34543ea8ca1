#!/usr/bin/env bash
# Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and kwok from the Go
# module proxy with the machine's Go toolchain. Outputs are cached by version outside the repository
# (${SERVEDMODEL_CACHE:-$HOME/.cache/servedmodel}/k8s-<version>/) and each binary is skipped when present.
# Nothing here is committed; see docs/control-plane.md.
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/k8s-${K8S_VERSION}"
BIN="${ROOT}/bin"
WORK="${ROOT}/work"
STAGES="${ROOT}/kwok-stages"
K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

have() { [[ -x "${BIN}/$1" ]]; }

missing=()
for b in etcd "${K8S_BINS[@]}" kwok; do have "$b" || missing+=("$b"); done
if [[ ${#missing[@]} -eq 0 && -d "${STAGES}" ]]; then
  log "all components present in ${BIN} (delete it to rebuild)"
  exit 0
fi
need_go "${missing[*]}"
mkdir -p "${BIN}" "${WORK}"
log "Go $(go env GOVERSION); building ${missing[*]} into ${BIN}"
start_all=$(date +%s)
timings=()

build_etcd() {
  # etcd's server/go.mod has relative replaces, so `go install` fails: use a throwaway module.
  local dir="${WORK}/etcd"
  rm -rf "${dir}" && mkdir -p "${dir}" && cd "${dir}"
  go mod init servedmodel.local/etcdbuild >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" || return 1
  go build -trimpath -ldflags "-s -w" -o "${BIN}/etcd.tmp" go.etcd.io/etcd/server/v3 || return 1
  mv "${BIN}/etcd.tmp" "${BIN}/etcd"
}

build_kwok() {
  local dir="${WORK}/kwok"
  rm -rf "${dir}" && mkdir -p "${dir}" && cd "${dir}"
  go mod init servedmodel.local/kwokbuild >/dev/null 2>&1
  go get "sigs.k8s.io/kwok@${KWOK_VERSION}" || return 1
  go build -trimpath -o "${BIN}/kwok.tmp" \
    -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" sigs.k8s.io/kwok/cmd/kwok
  mv "${BIN}/kwok.tmp" "${BIN}/kwok"
}

build_stages() {
  # kwok v0.8.0 standalone ships no built-in stages: keep the module's stage YAMLs next to the binary.
  local src
  src="$(go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" | jq -r .Dir)/kustomize/stage"
  rm -rf "${STAGES}.tmp" && mkdir -p "${STAGES}.tmp"
  cp "${src}/node/fast/node-initialize.yaml" \
    "${src}/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
    "${src}/pod/fast/pod-ready.yaml" "${src}/pod/fast/pod-complete.yaml" "${src}/pod/fast/pod-delete.yaml" \
    "${STAGES}.tmp/"
  chmod -R u+w "${STAGES}.tmp"
  rm -rf "${STAGES}" && mv "${STAGES}.tmp" "${STAGES}"
}

build_kubernetes() {
  # k8s.io/kubernetes requires its ~30 staging modules at v0.0.0 with `replace => ./staging/...`, so
  # `go install` fails. A throwaway module replaces each with its published v0.<minor>.<patch>; the
  # list and the godebug line come from upstream's go.mod, so they follow the pinned release.
  local dir="${WORK}/kubernetes" gomod staging_version="v0${K8S_VERSION#v1}"
  rm -rf "${dir}" && mkdir -p "${dir}" && cd "${dir}"
  gomod="$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | jq -r .GoMod)"
  {
    echo "module servedmodel.local/k8sbuild"
    echo
    echo "go $(go mod edit -json "${gomod}" | jq -r .Go)"
    grep -E '^godebug [^(]' "${gomod}" || true
    # A godebug block `godebug (\n ... \n)` is copied whole.
    awk '/^godebug \($/,/^\)$/' "${gomod}"
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    go mod edit -json "${gomod}" |
      jq -r --arg v "${staging_version}" '.Replace[] | select(.New.Path | startswith("./staging/")) | "\t\(.Old.Path) => \(.Old.Path) \($v)"'
    echo ")"
  } >go.mod
  log "throwaway module: $(grep -c ' => ' go.mod) staging replaces at ${staging_version}"
  local pkgs=()
  for b in "${K8S_BINS[@]}"; do have "$b" || pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  # Each package at the pinned version: a bare `go get PKG` means @upgrade and would pull the newest
  # k8s.io/kubernetes, whose staging modules do not match the replaces above.
  go get "${pkgs[@]/%/@${K8S_VERSION}}" || return 1
  local now ld=()
  now="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  local minor="${K8S_VERSION#v1.}"
  minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=("-X ${pkg}.gitVersion=${K8S_VERSION}" "-X ${pkg}.gitMajor=1" "-X ${pkg}.gitMinor=${minor}"
      "-X ${pkg}.gitTreeState=clean" "-X ${pkg}.buildDate=${now}")
  done
  mkdir -p "${WORK}/kubernetes/out"
  # One `go build` for all binaries shares the compile work of the common packages.
  go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w ${ld[*]}" -o "${WORK}/kubernetes/out/" "${pkgs[@]}" || return 1
  for b in "${K8S_BINS[@]}"; do
    [[ -x "${WORK}/kubernetes/out/$b" ]] && mv "${WORK}/kubernetes/out/$b" "${BIN}/$b"
  done
}

# errexit does not apply inside a subshell on the left of `||`, so the build steps return 1 themselves.
timed() {
  local name=$1 t0 rc=0
  t0=$(date +%s)
  log "building ${name}"
  ("build_${name}") || rc=$?
  timings+=("${name} $(($(date +%s) - t0))s rc=${rc}")
  log "${name}: $(($(date +%s) - t0))s rc=${rc}"
  return "${rc}"
}

failed=()
have etcd || timed etcd || failed+=(etcd)
have kwok || timed kwok || failed+=(kwok)
[[ -d "${STAGES}" ]] || timed stages || failed+=(kwok-stages)
for b in "${K8S_BINS[@]}"; do
  if ! have "$b"; then timed kubernetes || failed+=(kubernetes); break; fi
done

total=$(($(date +%s) - start_all))
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "go: $(go env GOVERSION) cores: $(nproc)"
  echo "built: ${missing[*]}"
  printf '%s\n' "${timings[@]}"
  echo "total: ${total}s"
} >>"${ROOT}/build-times.txt"
log "total ${total}s; timings appended to ${ROOT}/build-times.txt"
if [[ ${#failed[@]} -gt 0 ]]; then
  log "FAILED: ${failed[*]} (see output above); cluster tests will skip"
  exit 1
fi
