"""Build the real node's pause image locally (issue 22): no registry is reachable here.

hack/pause/main.go is compiled statically (CGO_ENABLED=0) and packed as a one-layer OCI image archive
(oci-layout, index.json, blobs/sha256/...) that `ctr -n k8s.io images import` accepts, tagged
``PAUSE_IMAGE``. Cached in ${SERVEDMODEL_CACHE:-~/.cache/servedmodel}/pause/; nothing is committed.

Usage: python hack/pause_image.py  (prints the archive's path)
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

HACK = Path(__file__).resolve().parent
PAUSE_IMAGE = "localhost/servedmodel/pause:local"
# The image's mtime and owner are fixed, so the same binary gives the same digests.
_EPOCH = 0


def cache_dir() -> Path:
    return Path(os.environ.get("SERVEDMODEL_CACHE", Path.home() / ".cache" / "servedmodel")) / "pause"


def build_binary(out: Path) -> None:
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GO111MODULE": "off"}
    subprocess.run(
        ["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out), str(HACK / "pause" / "main.go")],
        check=True,
        env=env,
    )


def _blob(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}"


def layer_tar(binary: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        data = binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, _EPOCH
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pack(binary: Path, archive: Path) -> None:
    """Write an OCI image layout archive holding ``binary`` as /pause, tagged PAUSE_IMAGE."""
    stage = archive.with_suffix(".d")
    blobs = stage / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    raw = layer_tar(binary)
    gz = gzip.compress(raw, mtime=_EPOCH)
    layer = _blob(blobs, gz)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]},
        },
        sort_keys=True,
    ).encode()
    config_digest = _blob(blobs, config)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer, "size": len(gz)}
            ],
        },
        sort_keys=True,
    ).encode()
    manifest_digest = _blob(blobs, manifest)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest),
                "annotations": {
                    "io.containerd.image.name": PAUSE_IMAGE,
                    "org.opencontainers.image.ref.name": "local",
                },
            }
        ],
    }
    (stage / "index.json").write_text(json.dumps(index))
    (stage / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name in ("oci-layout", "index.json", "blobs"):
            tar.add(stage / name, arcname=name)
    tmp.replace(archive)


def ensure_archive() -> Path:
    """The pause image archive, built when missing or older than hack/pause/main.go."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / "pause.oci.tar"
    source = HACK / "pause" / "main.go"
    if archive.exists() and archive.stat().st_mtime >= source.stat().st_mtime:
        return archive
    binary = cache / "pause"
    build_binary(binary)
    pack(binary, archive)
    return archive


if __name__ == "__main__":
    sys.stdout.write(f"{ensure_archive()}\n")
