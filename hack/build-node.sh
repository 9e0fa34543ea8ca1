#!/usr/bin/env bash
# Build a real node's components (issue 22) from the Go module proxy into the cache:
#   kubelet and kube-proxy at K8S_VERSION (the throwaway module of build-control-plane.sh, so the Go build
#   cache of kube-apiserver & co. is reused), containerd + ctr + containerd-shim-runc-v2 at CONTAINERD_VERSION
#   (static, CGO_ENABLED=0, with the tags that drop cgo-only snapshotters), the CNI plugins bridge,
#   host-local, loopback and portmap at CNI_PLUGINS_VERSION. runc is Debian's (apt-get installs it when
#   missing, as iptables for kube-proxy): it needs cgo and libseccomp to build from source.
# Outputs: ${CACHE}/node-<K8S>-<containerd>-<cni>/bin (cni plugins in bin/cni). Each is skipped when present;
# timings are appended to build-times.txt there. Nothing here is committed.
set -euo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ROOT="${CACHE}/node-${K8S_VERSION}-containerd-${CONTAINERD_VERSION}-cni-${CNI_PLUGINS_VERSION}"
BIN="${ROOT}/bin"
WORK="${ROOT}/work"
K8S_WORK="${CACHE}/k8s-${K8S_VERSION}/work/kubernetes"
CONTAINERD_BINS=(containerd ctr containerd-shim-runc-v2)
CNI_BINS=(bridge host-local loopback portmap)
# containerd's cgo-free build: no btrfs/devmapper/zfs snapshotters, no cri-o seccomp cgo path.
CONTAINERD_TAGS="no_btrfs no_devmapper no_zfs no_aufs no_dynamic_plugins osusergo netgo static_build"

have() { [[ -x "${BIN}/$1" ]]; }
need_go "kubelet, kube-proxy, containerd, CNI plugins"
mkdir -p "${BIN}/cni" "${WORK}"
timings=()
start_all=$(date +%s)

build_kubelet() {
  # Reuse build-control-plane.sh's throwaway module (its go.mod holds the staging replaces).
  [[ -f "${K8S_WORK}/go.mod" ]] || { log "run hack/build-control-plane.sh first (${K8S_WORK}/go.mod)"; return 1; }
  cd "${K8S_WORK}"
  go get "k8s.io/kubernetes/cmd/kubelet@${K8S_VERSION}" "k8s.io/kubernetes/cmd/kube-proxy@${K8S_VERSION}" || return 1
  local minor="${K8S_VERSION#v1.}" ld=()
  minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=("-X ${pkg}.gitVersion=${K8S_VERSION}" "-X ${pkg}.gitMajor=1" "-X ${pkg}.gitMinor=${minor}" "-X ${pkg}.gitTreeState=clean")
  done
  mkdir -p out-node
  go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w ${ld[*]}" -o out-node/ \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy || return 1
  mv out-node/kubelet out-node/kube-proxy "${BIN}/"
}

build_containerd() {
  local dir="${WORK}/containerd" mod=github.com/containerd/containerd/v2
  rm -rf "${dir}" && mkdir -p "${dir}" && cd "${dir}"
  go mod init servedmodel.local/containerdbuild >/dev/null 2>&1
  go get "${mod}@${CONTAINERD_VERSION}" || return 1
  mkdir -p out
  go build -p "${GO_BUILD_P:-2}" -trimpath -tags "${CONTAINERD_TAGS}" \
    -ldflags "-s -w -X ${mod}/version.Version=${CONTAINERD_VERSION}" -o out/ \
    "${mod}/cmd/containerd" "${mod}/cmd/ctr" "${mod}/cmd/containerd-shim-runc-v2" || return 1
  mv out/* "${BIN}/"
}

build_cni() {
  local dir="${WORK}/cni" mod=github.com/containernetworking/plugins
  rm -rf "${dir}" && mkdir -p "${dir}" && cd "${dir}"
  go mod init servedmodel.local/cnibuild >/dev/null 2>&1
  go get "${mod}@${CNI_PLUGINS_VERSION}" || return 1
  mkdir -p out
  go build -p "${GO_BUILD_P:-2}" -trimpath -ldflags "-s -w" -o out/ \
    "${mod}/plugins/main/bridge" "${mod}/plugins/ipam/host-local" "${mod}/plugins/main/loopback" \
    "${mod}/plugins/meta/portmap" || return 1
  mv out/* "${BIN}/cni/"
}

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
{ have kubelet && have kube-proxy; } || timed kubelet || failed+=(kubelet)
for b in "${CONTAINERD_BINS[@]}"; do
  if ! have "$b"; then timed containerd || failed+=(containerd); break; fi
done
for b in "${CNI_BINS[@]}"; do
  if [[ ! -x "${BIN}/cni/$b" ]]; then timed cni || failed+=(cni); break; fi
done
# Debian's packages of the commands the node runs (command:package), installed as root when missing.
apt_tools=(runc:runc iptables:iptables)
apt_missing=()
for pair in "${apt_tools[@]}"; do
  command -v "${pair%%:*}" >/dev/null || apt_missing+=("${pair#*:}")
done
if [[ ${#apt_missing[@]} -gt 0 ]]; then
  if [[ ${EUID} -eq 0 ]] && command -v apt-get >/dev/null; then
    apt=(apt-get -o DPkg::Lock::Timeout=300)
    install=("${apt[@]}" install -y -qq --no-install-recommends "${apt_missing[@]}")
    DEBIAN_FRONTEND=noninteractive "${install[@]}" \
      || { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${install[@]}"; } || true
  fi
  for pair in "${apt_tools[@]}"; do
    command -v "${pair%%:*}" >/dev/null || { log "no ${pair%%:*}: apt-get install ${pair#*:} (as root)"; failed+=("${pair#*:}"); }
  done
fi

total=$(($(date +%s) - start_all))
if [[ ${#timings[@]} -gt 0 ]]; then
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) go: $(go env GOVERSION) cores: $(nproc)"
    printf '%s\n' "${timings[@]}"
    echo "total: ${total}s"
  } >>"${ROOT}/build-times.txt"
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all node components present in ${BIN} (${total}s)"
