"""Run every benchmark under bench/ in turn, each in its own process, and let each print its table.

    make bench            # or: .venv/bin/python bench/run_all.py

The figures are for people, never assertions: the machines are shared and noisy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = [
    "sim_throughput.py",
    "probe_accuracy.py",
    "operator_reconcile.py",
    "replica_fault.py",
    "rollout_gate.py",
]


def main() -> int:
    here = Path(__file__).resolve().parent
    failed = []
    for name in BENCHES:
        print(f"\n=== {name} ===", flush=True)
        if subprocess.run([sys.executable, str(here / name)], check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
