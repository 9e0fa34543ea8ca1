"""Build the operator and simulator images for real from images/*/Containerfile (issue 22).

buildah runs each Containerfile unchanged but for its BASE build argument: the local Debian stand-in for
UBI's python-311 (hack/base_image.py), since Red Hat's registry is out of reach here. Its RUN steps run
with `--isolation chroot` (no runc, no container runtime) on the vfs storage driver, in a throwaway
storage folder; `pip install` inside reaches PyPI on the host's network, the host's CA bundle mounted
over the image's for the build only (a proxy's CA where there is one; not committed to the image).

Each image is written as an OCI archive that `ctr -n k8s.io images import` tags `reference(name)`
(localhost/servedmodel/<name>:dev), cached as
${SERVEDMODEL_CACHE:-~/.cache/servedmodel}/images/<name>-<key>.oci.tar, where <key> hashes the
Containerfile, every file its COPY lines take from the checkout (pyproject.toml, README.md, the
package's sources; __pycache__ left out), the base image's key and the build's flags: a second run
with nothing changed is a cache hit in well under a second; a change rebuilds (about a minute each).
The dependencies come from PyPI at build time, in the versions pyproject.toml allows (there is no
lock file for the images). Needs root, buildah and mmdebstrap (apt-get installs them when missing).

    python hack/images.py [operator|simulator ...]    # `make images`; prints name, reference, archive

From Python: `images.ensure("operator") -> (archive, "localhost/servedmodel/operator:dev")`;
`images.built("operator")` is the archive when it is cached for this checkout, else None (no build).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import base_image
import oci_archive

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ("operator", "simulator")
TAG = "dev"
TOOLS = {"buildah": "buildah", **base_image.TOOLS}
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# The build's own flags (part of the key: changing them rebuilds).
BUD_FLAGS = ("--isolation", "chroot", "--layers=false", "--format", "oci")
BUILD_TIMEOUT_S = 1800


def reference(name: str) -> str:
    return f"localhost/servedmodel/{name}:{TAG}"


def containerfile(name: str) -> Path:
    return ROOT / "images" / name / "Containerfile"


def copy_sources(path: Path) -> list[str]:
    """The checkout paths the Containerfile's COPY lines take (the build context is the repository root)."""
    sources: list[str] = []
    line = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") and not line:
            continue
        if stripped.endswith("\\"):
            line += stripped[:-1] + " "
            continue
        line += stripped
        words = shlex.split(line) if line.upper().startswith("COPY ") else []
        line = ""
        if not words:
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words):
            continue  # from another stage or image, not the checkout
        sources += args[:-1]
    return sources


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(
        p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def key(name: str) -> str:
    """What the image is built from: Containerfile, COPY sources, base image, build flags."""
    cf = containerfile(name)
    h = hashlib.sha256()
    h.update(f"flags {BUD_FLAGS!r} base {base_image.key()}\n".encode())
    for file in [cf, *(f for src in copy_sources(cf) for f in _files(ROOT / src))]:
        h.update(f"{file.relative_to(ROOT).as_posix()}\n".encode())
        h.update(hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()[:16]


def archive_path(name: str) -> Path:
    return base_image.cache_dir() / f"{name}-{key(name)}.oci.tar"


def built(name: str) -> Path | None:
    """The image's archive when it is cached for this checkout; None when it would have to be built."""
    archive = archive_path(name)
    if not archive.exists():
        return None
    base_image.used(archive)
    return archive


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT_S)
    if res.returncode != 0:
        raise base_image.BuildError(
            f"{what} failed ({res.returncode}): {shlex.join(cmd)}\n{res.stdout[-6000:]}{res.stderr[-6000:]}"
        )


def build(name: str, archive: Path) -> None:
    if os.geteuid() != 0:
        raise base_image.BuildError("the images are built as root (buildah --isolation chroot, vfs storage)")
    base_image.ensure_tools(TOOLS)
    base_archive, _ = base_image.ensure()
    with tempfile.TemporaryDirectory(prefix=f"{name}-build-", dir=base_image.cache_dir()) as tmp:
        work = Path(tmp)
        (work / "tmp").mkdir()
        env = {**os.environ, "TMPDIR": str(work / "tmp")}
        buildah = [
            "nice",
            "-n",
            "10",
            "buildah",
            "--root",
            str(work / "storage"),
            "--runroot",
            str(work / "run"),
            "--storage-driver",
            "vfs",
        ]
        volumes = ["--volume", f"{HOST_CA}:{HOST_CA}:ro"] if HOST_CA.exists() else []
        try:
            _run(
                [
                    *buildah,
                    "bud",
                    *BUD_FLAGS,
                    "--build-arg",
                    f"BASE=oci-archive:{base_archive}",
                    *volumes,
                    "-f",
                    str(containerfile(name)),
                    "-t",
                    reference(name),
                    str(ROOT),
                ],
                env,
                f"buildah bud ({name})",
            )
            layout = work / "layout"
            _run([*buildah, "push", "-q", reference(name), f"oci:{layout}"], env, f"buildah push ({name})")
            oci_archive.pack_layout(layout, archive, reference(name))
        finally:
            subprocess.run([*buildah, "rmi", "-a", "-f"], env=env, capture_output=True, check=False)


def ensure(name: str) -> tuple[Path, str]:
    """(archive, reference) of image `name`, built when this checkout's archive is not cached."""
    if name not in IMAGES:
        raise ValueError(f"unknown image {name!r}: one of {', '.join(IMAGES)}")
    archive = archive_path(name)
    if archive.exists():
        base_image.used(archive)
        return archive, reference(name)
    with base_image.locked(name):
        if not archive.exists():
            t0 = time.monotonic()
            build(name, archive)
            base_image.drop_stale(f"{name}-", archive)
            took = time.monotonic() - t0
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(base_image.cache_dir() / "build-times.txt", "a") as log:
                log.write(f"{stamp} {name} {archive.name} {took:.0f}s\n")
            print(f"[images] built {archive} in {took:.0f}s", file=sys.stderr)
    return archive, reference(name)


def main(argv: list[str]) -> int:
    names = argv or list(IMAGES)
    for name in names:
        t0 = time.monotonic()
        try:
            archive, ref = ensure(name)
        except base_image.BuildError as exc:
            print(f"[images] {name}: {exc}", file=sys.stderr)
            return 1
        print(f"{name} {ref} {archive} ({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
