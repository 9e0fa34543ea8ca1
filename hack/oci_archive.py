"""OCI image archives, written and read without a container engine (issue 22).

An archive is a plain (uncompressed) tar of an OCI image layout: `oci-layout`, `index.json` and
`blobs/sha256/<digest>`. Its index names the image in both annotations containerd's importer reads
(`io.containerd.image.name`, the full reference, and `org.opencontainers.image.ref.name`, its tag),
so `ctr -n k8s.io images import ARCHIVE` tags it, and buildah/skopeo read it as `oci-archive:ARCHIVE`.

`layer_blob` gzips a rootfs tar into a layer blob, `pack_layout` tars an OCI layout folder (buildah's
`push … oci:DIR`) with those annotations, and `read` gives an archive's manifest, config and layers.
Used by hack/base_image.py, hack/images.py, bench/image_size.py and tests/ship/test_built_images.py.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layer:
    digest: str  # sha256:… of the blob as stored (compressed)
    size: int  # bytes stored (compressed)
    media_type: str
    diff_id: str  # sha256:… of the uncompressed tar (the config's rootfs.diff_ids)
    created_by: str  # the config's history entry for it ("" when there is none)


@dataclass(frozen=True)
class Image:
    archive: Path
    reference: str
    manifest: dict[str, Any]
    config: dict[str, Any]
    layers: tuple[Layer, ...]

    def open_blob(self, digest: str) -> Iterator[bytes]:
        """The blob's bytes, in chunks, straight from the archive."""
        with tarfile.open(self.archive) as tar:
            member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None, digest
            while chunk := member.read(_CHUNK):
                yield chunk

    def uncompressed(self, layer: Layer) -> Iterator[bytes]:
        """The layer's tar, in chunks (gzip layers decompressed on the fly)."""
        if not layer.media_type.endswith("gzip"):
            yield from self.open_blob(layer.digest)
            return
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        for chunk in self.open_blob(layer.digest):
            yield inflate.decompress(chunk)
        yield inflate.flush()

    @contextmanager
    def layer_tar(self, layer: Layer) -> Iterator[tarfile.TarFile]:
        """The layer as a streaming tar (members in order; read each file before the next)."""
        with tarfile.open(self.archive) as outer:
            blob = outer.extractfile(f"blobs/sha256/{layer.digest.removeprefix('sha256:')}")
            assert blob is not None, layer.digest
            mode = "r|gz" if layer.media_type.endswith("gzip") else "r|"
            with tarfile.open(fileobj=blob, mode=mode) as tar:
                yield tar

    def unpack(self, dest: Path) -> None:
        """The image's filesystem into `dest`, layer over layer (whiteouts applied; as root, owners kept;
        device nodes left out)."""
        dest.mkdir(parents=True, exist_ok=True)
        for layer in self.layers:
            with self.layer_tar(layer) as tar:
                for member in tar:
                    if member.isdev() or _whiteout(dest, member):
                        continue
                    target = dest / member.name
                    if (target.is_symlink() or target.is_file()) and not member.isdir():
                        target.unlink()
                    tar.extract(member, dest, numeric_owner=True, filter="fully_trusted")


def _whiteout(dest: Path, member: tarfile.TarInfo) -> bool:
    """Apply an OCI whiteout entry (a deletion by a later layer); False for an ordinary entry."""
    parent, _, base = member.name.rpartition("/")
    if not base.startswith(".wh."):
        return False
    target = dest / parent
    if base == ".wh..wh..opq":  # opaque directory: what lower layers had there is gone
        for child in target.iterdir() if target.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    else:
        gone = target / base.removeprefix(".wh.")
        if gone.is_dir() and not gone.is_symlink():
            shutil.rmtree(gone)
        else:
            gone.unlink(missing_ok=True)
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def layer_blob(rootfs_tar: Path, blobs: Path, level: int = 6) -> tuple[str, str, int]:
    """Gzip `rootfs_tar` into `blobs` (an OCI layout's blobs/sha256); (digest, diff_id, size)."""
    blobs.mkdir(parents=True, exist_ok=True)
    tmp = blobs / "layer.tmp"
    with open(rootfs_tar, "rb") as src, gzip.GzipFile(tmp, mode="wb", compresslevel=level, mtime=0) as gz:
        while chunk := src.read(_CHUNK):
            gz.write(chunk)
    digest = _sha256(tmp)
    size = tmp.stat().st_size
    tmp.replace(blobs / digest)
    return f"sha256:{digest}", f"sha256:{_sha256(rootfs_tar)}", size


def put_json(blobs: Path, doc: dict[str, Any]) -> tuple[str, int]:
    """Store `doc` as a blob; (digest, size)."""
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def write_layout(layout: Path, config: dict[str, Any], layers: list[tuple[str, int]]) -> None:
    """index.json + oci-layout for one image; its gzip layers ((digest, size)) are in layout/blobs."""
    blobs = layout / "blobs" / "sha256"
    config_digest, config_size = put_json(blobs, config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": LAYER_GZIP, "digest": d, "size": s} for d, s in layers],
    }
    manifest_digest, manifest_size = put_json(blobs, manifest)
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": MANIFEST, "digest": manifest_digest, "size": manifest_size}],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))


def pack_layout(layout: Path, archive: Path, reference: str) -> None:
    """Tar the one-image OCI layout `layout` into `archive`, its index naming `reference`."""
    index = json.loads((layout / "index.json").read_text())
    assert len(index["manifests"]) == 1, f"{layout}: expected one image, found {len(index['manifests'])}"
    tag = reference.rpartition(":")[2]
    for entry in index["manifests"]:
        entry["annotations"] = {
            **entry.get("annotations", {}),
            "io.containerd.image.name": reference,
            "org.opencontainers.image.ref.name": tag,
        }
    (layout / "index.json").write_text(json.dumps(index))
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("oci-layout", "index.json"):
            tar.add(layout / name, arcname=name)
        tar.add(layout / "blobs", arcname="blobs", recursive=False)
        tar.add(layout / "blobs" / "sha256", arcname="blobs/sha256", recursive=False)
        for blob in sorted((layout / "blobs" / "sha256").iterdir()):
            tar.add(blob, arcname=f"blobs/sha256/{blob.name}")
    tmp.replace(archive)


def _json_member(tar: tarfile.TarFile, name: str) -> Any:
    member = tar.extractfile(name)
    assert member is not None, name
    return json.loads(member.read())


def read(archive: Path) -> Image:
    """The one image in `archive`: its reference, manifest, config and layers."""
    with tarfile.open(archive) as tar:
        index = _json_member(tar, "index.json")
        (entry,) = index["manifests"]
        manifest = _json_member(tar, f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}")
        config = _json_member(tar, f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}")
    annotations = entry.get("annotations", {})
    reference = annotations.get(
        "io.containerd.image.name", annotations.get("org.opencontainers.image.ref.name", "")
    )
    history = [h for h in config.get("history", []) if not h.get("empty_layer")]
    diff_ids = config["rootfs"]["diff_ids"]
    layers = tuple(
        Layer(
            digest=d["digest"],
            size=d["size"],
            media_type=d["mediaType"],
            diff_id=diff_ids[i],
            created_by=history[i].get("created_by", "") if i < len(history) else "",
        )
        for i, d in enumerate(manifest["layers"])
    )
    return Image(archive, reference, manifest, config, layers)
