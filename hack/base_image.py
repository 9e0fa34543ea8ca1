"""A local stand-in for UBI 9's python-311 image, the images' BASE where Red Hat's registry is out of reach.

images/*/Containerfile start `FROM ${BASE}`, UBI's registry.access.redhat.com/ubi9/python-311 by
default. This machine reaches only package registries, so hack/images.py builds them on this base
instead: a Debian bookworm rootfs made by mmdebstrap (no container runtime: debootstrap-style, as
root) with Python 3.11 and laid out as UBI's image is, which is what the Containerfiles rely on:

- a venv at /opt/app-root (its bin/ first on PATH, pip in it), HOME and WORKDIR /opt/app-root/src;
- user 1001 (`default`) with GID 0, /opt/app-root owned 1001:0 and group-0 writable (OpenShift runs
  the container under an arbitrary UID in group 0);
- UBI's environment (APP_ROOT, VIRTUAL_ENV, PYTHONUNBUFFERED, PYTHONIOENCODING, …), LANG C.UTF-8.

The rootfs tar becomes one gzip layer of an OCI archive (hack/oci_archive.py) tagged
`localhost/servedmodel/python-311-base:<key>`, cached as
${SERVEDMODEL_CACHE:-~/.cache/servedmodel}/images/base-<key>.oci.tar, where <key> is this file's
hash: editing the recipe rebuilds it, nothing else does (delete the archive for newer Debian packages).
About a minute cold. Needs root (mmdebstrap --mode=root) and mmdebstrap (apt-get installs it).

Usage: python hack/base_image.py  (prints the archive's path and the image reference)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import oci_archive

HERE = Path(__file__).resolve()
BASE_IMAGE = "localhost/servedmodel/python-311-base"
SUITE = "bookworm"
MIRRORS = (
    f"deb http://deb.debian.org/debian {SUITE} main",
    f"deb http://deb.debian.org/debian {SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {SUITE}-security main",
)
# python3.11-venv: venv and ensurepip's bundled pip/setuptools wheels (no download for the venv's pip).
PACKAGES = ("python3.11", "python3.11-venv", "ca-certificates")
APP_ROOT = "/opt/app-root"
APP_UID = 1001
ENV = {
    "PATH": f"{APP_ROOT}/src/.local/bin:{APP_ROOT}/src/bin:{APP_ROOT}/bin:"
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "APP_ROOT": APP_ROOT,
    "HOME": f"{APP_ROOT}/src",
    "VIRTUAL_ENV": APP_ROOT,
    "PYTHON_VERSION": "3.11",
    "PYTHONUNBUFFERED": "1",
    "PYTHONIOENCODING": "UTF-8",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PIP_NO_CACHE_DIR": "off",
}
# Docs, man pages and translations stay out (copyright files stay in).
DPKG_OPTS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
)
CUSTOMIZE = (
    f'chroot "$1" python3.11 -m venv {APP_ROOT}',
    f'chroot "$1" useradd --uid {APP_UID} --gid 0 --home-dir {APP_ROOT}/src --no-create-home'
    ' --shell /sbin/nologin --comment "Default Application User" default',
    f'mkdir -p "$1{APP_ROOT}/src" && chown -R {APP_UID}:0 "$1{APP_ROOT}" && chmod -R g+rwX "$1{APP_ROOT}"',
    # What the build left that an image does not need.
    'rm -rf "$1/var/cache/apt"/*.bin "$1/var/lib/apt/lists"/* "$1/var/log"/*.log "$1/tmp"/*',
)
TOOLS = {"mmdebstrap": "mmdebstrap"}


class BuildError(RuntimeError):
    """A build step failed or a tool it needs cannot be had."""


def cache_dir() -> Path:
    return Path(os.environ.get("SERVEDMODEL_CACHE", Path.home() / ".cache" / "servedmodel")) / "images"


def key() -> str:
    return hashlib.sha256(HERE.read_bytes()).hexdigest()[:16]


def reference() -> str:
    return f"{BASE_IMAGE}:{key()}"


def archive_path() -> Path:
    return cache_dir() / f"base-{key()}.oci.tar"


def ensure_tools(tools: dict[str, str]) -> None:
    """apt-get install the Debian packages of the commands in `tools` (command: package) missing here."""
    missing = sorted({pkg for cmd, pkg in tools.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install {' '.join(missing)} (as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]
    install = [*apt, "install", "-y", "-qq", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, check=False).returncode != 0:
        subprocess.run([*apt, "update", "-qq"], env=env, check=True)
        subprocess.run(install, env=env, check=True)


@contextmanager
def locked(name: str) -> Iterator[None]:
    """One builder at a time per `name` (parallel pytest workers, two shells)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# An earlier build is kept while it may still be in use: another checkout on this machine (a second clone,
# a CI run beside an edit) tests the archive its session first found, and dropping it at once failed that
# run's built-image tests midway. Every use marks the archive (used()); past this age unused, it goes.
STALE_AFTER_S = 3 * 3600.0


def used(archive: Path) -> None:
    """Mark `archive` as in use now (its mtime), so that drop_stale keeps it a while longer."""
    with contextlib.suppress(OSError):  # read-only cache, or removed meanwhile: only the keeping is lost
        os.utime(archive)


def drop_stale(prefix: str, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the cache's earlier builds (`prefix`*.oci.tar other than `keep`) unused for STALE_AFTER_S."""
    now = time.time() if now is None else now
    dropped = []
    for old in cache_dir().glob(f"{prefix}*.oci.tar"):
        try:
            stale = old != keep and now - old.stat().st_mtime > STALE_AFTER_S
        except FileNotFoundError:
            continue
        if stale:
            old.unlink(missing_ok=True)
            dropped.append(old)
    return dropped


def _architecture() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def build_rootfs(out: Path) -> None:
    """The Debian rootfs as a tar (mmdebstrap, as root: it chroots to run dpkg and the hooks)."""
    if os.geteuid() != 0:
        raise BuildError("the base image's rootfs is built as root (mmdebstrap --mode=root)")
    ensure_tools(TOOLS)
    cmd = [
        "nice",
        "-n",
        "10",
        "mmdebstrap",
        "--quiet",
        "--mode=root",
        "--variant=minbase",
        "--format=tar",
        "--skip=output/dev",
        f"--include={','.join(PACKAGES)}",
        *(f"--dpkgopt={o}" for o in DPKG_OPTS),
        *(f"--customize-hook={h}" for h in CUSTOMIZE),
        SUITE,
        str(out),
        *MIRRORS,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if res.returncode != 0:
        raise BuildError(f"mmdebstrap failed ({res.returncode}):\n{res.stdout[-4000:]}{res.stderr[-4000:]}")


def image_config(diff_id: str) -> dict[str, object]:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "architecture": _architecture(),
        "os": "linux",
        "created": created,
        "config": {
            "Env": [f"{k}={v}" for k, v in ENV.items()],
            "User": str(APP_UID),
            "WorkingDir": f"{APP_ROOT}/src",
            "Labels": {
                "name": "servedmodel-python-311-base",
                "summary": f"Debian {SUITE} + Python 3.11 laid out as UBI 9's python-311 (local builds only)",
                "org.opencontainers.image.base.name": f"debian:{SUITE}",
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [
            {
                "created": created,
                "created_by": f"hack/base_image.py: mmdebstrap {SUITE} minbase + {' '.join(PACKAGES)}, "
                f"venv {APP_ROOT}, user {APP_UID}:0",
            }
        ],
    }


def build(archive: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="base-", dir=cache_dir()) as tmp:
        work = Path(tmp)
        rootfs = work / "rootfs.tar"
        build_rootfs(rootfs)
        layout = work / "layout"
        blobs = layout / "blobs" / "sha256"
        digest, diff_id, size = oci_archive.layer_blob(rootfs, blobs)
        rootfs.unlink()
        oci_archive.write_layout(layout, image_config(diff_id), [(digest, size)])
        oci_archive.pack_layout(layout, archive, reference())


def ensure() -> tuple[Path, str]:
    """(archive, reference) of the base image, built when this recipe's archive is not cached."""
    archive = archive_path()
    if archive.exists():
        used(archive)
        return archive, reference()
    with locked("base"):
        if not archive.exists():
            t0 = time.monotonic()
            build(archive)
            drop_stale("base-", archive)
            took = time.monotonic() - t0
            with open(cache_dir() / "build-times.txt", "a") as log:
                log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} base {key()} {took:.0f}s\n")
            print(f"[base_image] built {archive} in {took:.0f}s", file=sys.stderr)
    return archive, reference()


if __name__ == "__main__":
    path, ref = ensure()
    sys.stdout.write(f"{path} {ref}\n")
