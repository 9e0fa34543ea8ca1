"""Size of the real images, layer by layer: compressed (what a pull moves) and uncompressed (what the
node's disk holds), from the OCI archives hack/images.py builds (`make images`; built here when missing).

    .venv/bin/python bench/image_size.py            # the built images, per layer and in total
    .venv/bin/python bench/image_size.py --venv     # the Python packages alone: a real `pip install`

Per layer: its compressed size (the manifest's), its uncompressed tar (streamed through gzip here), the
files in it, and how much of it is the venv's site-packages (/opt/app-root/lib/python3.11/site-packages).
The base layer (hack/base_image.py's Debian + Python 3.11 stand-in for UBI's python-311) is the same blob
in both images: "both images" counts it once. UBI's own base is larger; these figures are for the local
base, the layer the Containerfile adds is what it would add on UBI too.

`--venv` replays what the Containerfiles install (`pip install <src>` and `pip install '<src>[sim]'`)
into fresh virtual environments and prints their site-packages less an empty venv's (pip itself); it
downloads from PyPI (pip's cache helps a second run). hack/image_closure.py gives the offline estimate.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))
import images  # noqa: E402  (hack/ is tooling, not a package)
import oci_archive  # noqa: E402

VENV_IMAGES = {"operator": "", "simulator": "[sim]"}
PIP_TIMEOUT_S = 900


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def venv_sizes() -> int:
    with tempfile.TemporaryDirectory(prefix="image-size-") as tmp:
        work = Path(tmp)
        src = work / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(
            ROOT / "operator" / "servedmodel",
            src / "operator" / "servedmodel",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        empty = work / "empty"
        venv.EnvBuilder(with_pip=True).create(empty)
        base = _tree_bytes(_site_packages(empty))
        print(f"{'image':<10} {'pip install':<22} {'packages':>8} {'site-packages MiB':>18}")
        for image, extra in VENV_IMAGES.items():
            env = work / image
            venv.EnvBuilder(with_pip=True).create(env)
            py = env / "bin" / "python"
            subprocess.run(
                [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{src}{extra}"],
                check=True,
                timeout=PIP_TIMEOUT_S,
            )
            listed = subprocess.run(
                [str(py), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout.split()
            size = (_tree_bytes(_site_packages(env)) - base) / 2**20
            print(f"{image:<10} {'servedmodel' + extra:<22} {len(listed) - 1:>8} {size:>18.1f}")
    return 0


SITE_PACKAGES = "opt/app-root/lib/python3.11/site-packages/"
MIB = 2**20


def layer_figures(image: oci_archive.Image, layer: oci_archive.Layer) -> tuple[int, int, int]:
    """(uncompressed bytes of the layer's tar, files in it, bytes of them under site-packages)."""
    raw = sum(len(chunk) for chunk in image.uncompressed(layer))
    files = site = 0
    with image.layer_tar(layer) as tar:
        for member in tar:
            if member.isfile():
                files += 1
                if member.name.removeprefix("./").startswith(SITE_PACKAGES):
                    site += member.size
    return raw, files, site


def real_sizes(names: list[str]) -> int:
    print(
        f"{'image':<10} {'layer':<14} {'what':<44} {'compressed MiB':>14} {'uncompressed MiB':>16} "
        f"{'files':>7} {'site-packages MiB':>17}"
    )
    seen: dict[str, tuple[int, int]] = {}
    for name in names:
        archive, _ = images.ensure(name)
        image = oci_archive.read(archive)
        total_c = total_u = 0
        for i, layer in enumerate(image.layers):
            raw, files, site = layer_figures(image, layer)
            what = (
                "base: Debian bookworm + Python 3.11 venv"
                if i == 0
                else "Containerfile: COPY + RUN pip install"
            )
            sizes = f"{layer.size / MIB:>14.1f} {raw / MIB:>16.1f} {files:>7} {site / MIB:>17.1f}"
            print(f"{name:<10} {layer.digest[7:19]:<14} {what:<44} {sizes}")
            total_c += layer.size
            total_u += raw
            seen[layer.digest] = (layer.size, raw)
        print(f"{name:<10} {'total':<14} {image.reference:<44} {total_c / MIB:>14.1f} {total_u / MIB:>16.1f}")
    if len(names) > 1:
        both_c = sum(c for c, _ in seen.values())
        both_u = sum(u for _, u in seen.values())
        sizes = f"{both_c / MIB:>14.1f} {both_u / MIB:>16.1f}"
        print(f"{'both':<10} {'images':<14} {'(shared layers once)':<44} {sizes}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="Size of the real images, layer by layer (make images).")
    parser.add_argument(
        "--venv", action="store_true", help="the Python packages alone: pip install into venvs"
    )
    parser.add_argument("images", nargs="*", default=list(images.IMAGES), help="which images (default: all)")
    args = parser.parse_args()
    return venv_sizes() if args.venv else real_sizes(args.images)


if __name__ == "__main__":
    sys.exit(main())
