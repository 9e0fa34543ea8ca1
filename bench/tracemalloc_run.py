"""Run a module (the operator) under tracemalloc; SIGUSR1 writes where its memory is, by file and line,
to $TRACEMALLOC_OUT. Bench-only: bench/operator_scale.py --memory-profile starts the operator this way.

    python bench/tracemalloc_run.py servedmodel.cli run -n bench ...
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType


def dump(_signum: int, _frame: FrameType | None) -> None:
    snapshot = tracemalloc.take_snapshot()
    by_file = snapshot.statistics("filename")
    by_line = snapshot.statistics("lineno")
    total = sum(s.size for s in by_file)
    lines = [f"traced {total / 1e6:.1f} MB", "", "by file:"]
    lines += [f"{s.size / 1e6:8.1f} MB  {s.count:9d}  {s.traceback[0].filename}" for s in by_file[:25]]
    lines += ["", "by line:"]
    lines += [f"{s.size / 1e6:8.1f} MB  {s.count:9d}  {s.traceback[0]}" for s in by_line[:40]]
    Path(os.environ["TRACEMALLOC_OUT"]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    tracemalloc.start(1)
    signal.signal(signal.SIGUSR1, dump)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
