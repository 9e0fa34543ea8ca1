"""The control loop under the faults real clusters produce, on one local control plane (hack/faults.py's
scenarios; tests/cluster/test_faults.py asserts the same ones converge):

- 410 relist: the operator SIGSTOPped, half its 20 models deleted, the API server restarted and etcd
  compacted past the operator's resourceVersions, the operator thawed;
- API server restart: SIGKILLed mid-burst of 30 creates, back 20 s later; then a third of the models
  deleted, and one Deployment deleted behind the operator's back;
- etcd paused 30 s and 90 s (SIGSTOP); afterwards 3 models deleted and 3 created;
- leader kill x N: two operators on one namespace, the leader SIGKILLed N times (a new follower each time);
- delete/recreate x 100: one name deleted and created again 100 times while the probe writes its status.

Per fault: seconds from the fault's end until the operator's cache equals the API's lists and every model
has its status and Deployment; ghosts (cached or probed objects the API no longer has); duplicates
(children of deleted owners recreated, Deployments re-applied with a change, writes by a follower);
operator restarts; the most Events posted for one transition. Leader kills: failover p50 / max.

    .venv/bin/python bench/operator_faults.py                 # every fault, leader killed 10 times
    .venv/bin/python bench/operator_faults.py --leader-kills 3 --only leader
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_support import OperatorProcess, controlplane, prepare, scrape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack"))
import faults

NO_ENGINE = "http://127.0.0.1:9"


class Running:
    """bench_support's OperatorProcess, entered, with what hack/faults.Operator asks."""

    def __init__(self, op: OperatorProcess) -> None:
        self.op = op
        assert op.proc is not None
        self.proc = op.proc

    @property
    def pid(self) -> int:
        return self.op.pid

    @property
    def health_port(self) -> int:
        return self.op.health_port

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.op.metrics_port}/metrics", timeout=30) as r:
            return str(r.read().decode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leader-kills", type=int, default=10)
    parser.add_argument("--only", choices=["410", "restart", "etcd", "leader", "recreate"], action="append")
    args = parser.parse_args(argv)
    rows: list[faults.Row] = []
    started: list[OperatorProcess] = []
    logs = Path(tempfile.mkdtemp(prefix="operator-faults-"))

    def start(namespace: str, env: dict[str, str]) -> Any:
        op = OperatorProcess(
            controlplane_, namespace, endpoint_override=NO_ENGINE, log=logs / f"op-{len(started)}.log"
        )
        op.__enter__()
        started.append(op)
        scrape(op.metrics_port)  # answers
        return Running(op)

    with controlplane.running(apiserver_flags=faults.FAULT_APISERVER_FLAGS) as controlplane_:
        prepare(controlplane_, "bench-setup")
        scenarios = [
            ("410", lambda ns: faults.relist_410(controlplane_, start, ns)),
            ("restart", lambda ns: faults.apiserver_restart(controlplane_, start, ns)),
            ("etcd", lambda ns: faults.etcd_pause(controlplane_, start, ns, 30)),
            ("etcd", lambda ns: faults.etcd_pause(controlplane_, start, ns, 90)),
            ("leader", lambda ns: faults.leader_kill(controlplane_, start, ns, rounds=args.leader_kills)),
            ("recreate", lambda ns: faults.delete_recreate(controlplane_, start, ns, rounds=100)),
        ]
        for i, (key, run) in enumerate(scenarios):
            if args.only and key not in args.only:
                continue
            namespace = f"faults-{i}"
            controlplane_.kubectl("create", "namespace", namespace)
            try:
                row = run(namespace)
            finally:
                for op in started:
                    op.stop()
                started.clear()
            rows.append(row)
            print(faults.table([row]).splitlines()[-1], flush=True)
            if row.health_during:
                print(f"  while the API server was away: {row.health_during}", flush=True)
    print()
    print(faults.table(rows))
    kills = [s for r in rows for s in r.samples]
    if kills:
        print(
            f"\nleader failover over {len(kills)} kills: "
            f"p50 {statistics.median(kills):.1f} s, max {max(kills):.1f} s"
        )
    print(f"operator logs in {logs}")
    return (
        0
        if all(r.converge_s is not None and not (r.ghosts or r.duplicates or r.restarts) for r in rows)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
