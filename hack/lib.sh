# shellcheck shell=bash
# What hack/build-*.sh share, sourced after `set -euo pipefail`: HACK_DIR, the pins (versions.env), the
# cache folder outside the repository (CACHE), Go's settings, `log` (named after the script), `need_go`
# and `exit_if_built`.

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/versions.env
source "${HACK_DIR}/versions.env"

CACHE="${SERVEDMODEL_CACHE:-${HOME}/.cache/servedmodel}"

# Never fetch a different Go toolchain behind the user's back; build static binaries.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod"

LOG_NAME="$(basename "$0" .sh)"
log() { printf '[%s] %s\n' "${LOG_NAME}" "$*" >&2; }

# need_go WHAT: exit 1 unless a Go toolchain is on PATH (WHAT: what could not be built without it).
need_go() {
  command -v go >/dev/null || { log "no Go toolchain on PATH: cannot build $1"; exit 1; }
}

# exit_if_built FILE: exit 0 (nothing to do) when FILE is an executable already.
exit_if_built() {
  if [[ -x "$1" ]]; then
    log "present: $1 (delete it to rebuild)"
    exit 0
  fi
}
