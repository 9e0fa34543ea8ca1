"""Start a simulator for tests and benches.

Subprocess (what other parts' tests use)::

    from servedmodel.sim.process import SimulatorProcess

    with SimulatorProcess(["--max-num-seqs", "4", "--served-model-name", "qwen"]) as sim:
        httpx.get(f"{sim.base_url}/v1/models", timeout=5)   # sim.port, sim.pid, sim.log_text()

It runs `python -m servedmodel.sim --host 127.0.0.1 --port <free port> ARGS`, waits until /health answers
200 (with `--sim-startup-delay` or `--sim-dead` in ARGS: until the port accepts connections), and on exit
stops it by its pid (SIGTERM, then SIGKILL after 5 s). `await SimulatorProcess(...).astart()` /
`await sim.astop()` and `async with` do the same without blocking an event loop.

In-process (same event loop; benches and tests that want the Simulator object)::

    async with InProcessSimulator(["--max-num-seqs", "4"]) as sim:
        sim.base_url, sim.simulator.engine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO

from aiohttp import web

from servedmodel.sim.cli import add_arguments, settings_from_args
from servedmodel.sim.ports import free_port, health_status, port_open
from servedmodel.sim.server import Simulator


class SimulatorProcess:
    """`servedmodel sim` as a child process on 127.0.0.1 and a free port; stopped by pid on exit."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        ready_timeout: float = 30.0,
        cpu: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._cpu = cpu
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("simulator not started")
        return self._proc.pid

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "servedmodel.sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        if self._cpu is not None and os.path.exists("/usr/bin/taskset"):
            cmd = ["/usr/bin/taskset", "-c", str(self._cpu), *cmd]
        return cmd

    def _spawn(self) -> None:
        self._log = tempfile.TemporaryFile(prefix="servedmodel-sim-")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, **(self._env or {})}
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def _probe_ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise RuntimeError(f"simulator exited with {self._proc.returncode}:\n{self.log_text()}")
        if "--sim-startup-delay" in self.args or "--sim-dead" in self.args:
            return port_open(self.port, 0.5)
        return health_status(self.port, 1.0) == 200

    def start(self) -> SimulatorProcess:
        self._spawn()
        deadline = time.monotonic() + self.ready_timeout
        try:
            while not self._probe_ready():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"simulator not ready in {self.ready_timeout} s:\n{self.log_text()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    async def astart(self) -> SimulatorProcess:
        self._spawn()
        deadline = time.monotonic() + self.ready_timeout
        try:
            while not await asyncio.to_thread(self._probe_ready):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"simulator not ready in {self.ready_timeout} s:\n{self.log_text()}")
                await asyncio.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SimulatorProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
        self.close_log()

    async def __aenter__(self) -> SimulatorProcess:
        return await self.astart()

    async def __aexit__(self, *_: object) -> None:
        await self.astop()
        self.close_log()


class InProcessSimulator:
    """The simulator's app in the running event loop, on 127.0.0.1 and a free port."""

    def __init__(self, args: Sequence[str] = ()) -> None:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        self.port = free_port()
        ns = parser.parse_args([*args, "--host", "127.0.0.1", "--port", str(self.port)])
        self.settings = settings_from_args(ns)
        self.simulator = Simulator(self.settings)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> InProcessSimulator:
        self._runner = web.AppRunner(self.simulator.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
