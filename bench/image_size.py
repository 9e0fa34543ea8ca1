"""Installed size of each image's Python packages: a real `pip install` of the checkout into fresh venvs.

    .venv/bin/python bench/image_size.py

Replays what images/operator and images/simulator do (`pip install <src>` and `pip install '<src>[sim]'`)
into two fresh virtual environments and prints the size of their site-packages, less what an empty
venv has (pip itself). This downloads from PyPI (pip's cache helps a second run), so it is a benchmark,
not a test; hack/image_closure.py gives the offline estimate from the project venv.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"operator": "", "simulator": "[sim]"}
PIP_TIMEOUT_S = 900


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def main() -> int:
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
        for image, extra in IMAGES.items():
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


if __name__ == "__main__":
    sys.exit(main())
