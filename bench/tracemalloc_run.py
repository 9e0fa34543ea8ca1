"""Run a module (the operator) under tracemalloc; SIGUSR1 writes where its memory is, by file and line,
to $TRACEMALLOC_OUT. Bench-only: bench/operator_scale.py --memory-profile starts the operator this way.

    python bench/tracemalloc_run.py servedmodel.cli run -n bench ...

TRACEMALLOC_FRAMES=N (default 1) keeps N frames per allocation and adds the biggest sites' call stacks.
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
    if FRAMES > 1:  # who holds it: the allocation's callers, for the biggest sites
        lines += ["", f"by traceback ({FRAMES} frames, innermost last):"]
        for s in snapshot.statistics("traceback")[:25]:
            lines += [f"{s.size / 1e6:8.1f} MB  {s.count:9d}", *(f"        {f}" for f in s.traceback)]
    Path(os.environ["TRACEMALLOC_OUT"]).write_text("\n".join(lines) + "\n")


FRAMES = int(os.environ.get("TRACEMALLOC_FRAMES", "1"))

if __name__ == "__main__":
    tracemalloc.start(FRAMES)
    signal.signal(signal.SIGUSR1, dump)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
