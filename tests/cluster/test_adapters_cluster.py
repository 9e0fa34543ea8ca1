"""spec.adapters through the operator on the real control plane: three kwok engine pods, each mapped to
its own simulator on 127.0.0.1 (LoRA on, runtime loading allowed), the prober loading the declared
adapters on every replica and probing each; `kubectl get sm` shows ADAPTERS serving/declared; a replica
that restarts (a fresh engine behind its pod) gets its adapters again; an adapter removed from the spec is
unloaded everywhere; a broken one (a rank over the engine's --max-lora-rank) is named in AdaptersServing
while the base model keeps serving. Adapters are real PEFT folders (hack/lora_adapters.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, condition, served_model

import controlplane
from lora_adapters import write_adapter
from rollout_rig import write_override
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster
WAIT_S = 120.0
SIM_ARGS = [
    "Qwen/Qwen2.5-0.5B-Instruct",
    "--served-model-name",
    "qwen",
    "--max-model-len",
    "4096",
    "--sim-step-base-ms",
    "2",
    "--enable-lora",
    "--max-loras",
    "4",
    "--max-lora-rank",
    "16",
]
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


def sm(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    got: dict[str, Any] = cp.get_json("servedmodel", "qwen", "-n", namespace)
    return got


def adapters_of(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["name"]: a for a in ((obj.get("status") or {}).get("probe") or {}).get("adapters") or []}


def column(table: list[str], name: str) -> str:
    """A `kubectl get` column of the first row, by the header's offsets (an empty cell stays empty)."""
    header = table[0]
    start = header.index(name)
    rest = header[start + len(name) :]
    width = len(name) + len(rest) - len(rest.lstrip()) if rest.strip() else len(table[1]) - start
    return table[1][start : start + width].strip()


def listed(sim: SimulatorProcess) -> list[str]:
    data = httpx.get(f"{sim.base_url}/v1/models", timeout=10).json()["data"]
    return sorted(c["id"] for c in data if c["parent"])


def test_adapters_on_three_replicas_restart_remove_and_broken(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any, tmp_path: Path
) -> None:
    cp = control_plane
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    folders = {
        name: write_adapter(tmp_path / "model", tmp_path / name, rank=rank, seed=i)
        for i, (name, rank) in enumerate([("sql", 8), ("poet", 8), ("chat", 8), ("wide", 32)])
    }

    def declared(*names: str) -> list[dict[str, Any]]:
        return [{"name": n, "source": str(folders[n])} for n in names]

    override = tmp_path / "endpoints"
    override.write_text("# filled once the pods exist\n")
    with (
        SimulatorProcess(SIM_ARGS, env=RUNTIME, ready_timeout=60) as s0,
        SimulatorProcess(SIM_ARGS, env=RUNTIME, ready_timeout=60) as s1,
        SimulatorProcess(SIM_ARGS, env=RUNTIME, ready_timeout=60) as s2,
    ):
        sims = [s0, s1, s2]
        op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")
        probe = {
            "interval": 5,
            "readinessGate": False,
            "firstByteTimeout": 5,
            "timeout": 10,
            "checkLimits": False,
        }
        body = served_model("qwen", replicas=3, servedModelName="qwen", probe=probe)
        body["spec"]["adapters"] = declared("sql", "poet", "chat")
        apply(cp, namespace, body)

        def three_pods() -> list[str] | None:
            pods = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")["items"]
            running = sorted(
                p["metadata"]["name"]
                for p in pods
                if (p.get("status") or {}).get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")
            )
            return running if len(running) == 3 else None

        names = cluster_support.wait_for("three engine pods running", three_pods, WAIT_S, detail=op.log)
        container = cp.get_json("deployment", "qwen", "-n", namespace)["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert container["args"][-5:] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
        assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container["env"]

        def map_pods(engines: list[SimulatorProcess]) -> None:
            write_override(
                override, [f"{namespace}/qwen/{n}={s.base_url}" for n, s in zip(names, engines, strict=True)]
            )

        map_pods(sims)

        def adapters_serving(want: str, **loaded: str) -> Any:
            def check() -> Any:
                obj = sm(cp, namespace)
                entries = adapters_of(obj)
                probe = (obj.get("status") or {}).get("probe") or {}
                ok = probe.get("adaptersServing") == want and all(
                    (entries.get(n) or {}).get("loaded") == v for n, v in loaded.items()
                )
                return obj if ok else None

            return cluster_support.wait_for(
                f"adapters serving {want} ({loaded})", check, WAIT_S, detail=op.log
            )

        obj = adapters_serving("3/3", sql="3/3", poet="3/3", chat="3/3")
        for name in ("sql", "poet", "chat"):
            entry = adapters_of(obj)[name]
            assert entry["serving"] == "True"
            assert [p["name"] for p in entry["pods"]] == names
            assert entry["ttftMs"] > 0
        assert condition(obj, "AdaptersServing")["status"] == "True"
        assert all(listed(s) == ["chat", "poet", "sql"] for s in sims)
        table = cp.kubectl("get", "sm", "-n", namespace).stdout.splitlines()
        print("\n".join(table))  # the docs' example (docs/operations.md "Adapters")
        assert column(table, "ADAPTERS") == "3/3", table

        # replica 1 restarted: a fresh engine behind its pod, with no adapter; it gets all three again
        with SimulatorProcess(SIM_ARGS, env=RUNTIME, ready_timeout=60) as fresh:
            assert listed(fresh) == []
            map_pods([s0, fresh, s2])
            cluster_support.wait_for(
                "the restarted replica's adapters loaded again",
                lambda: listed(fresh) == ["chat", "poet", "sql"],
                WAIT_S,
                detail=op.log,
            )
            adapters_serving("3/3", sql="3/3", poet="3/3", chat="3/3")
            map_pods(sims)
            # the fresh engine stops only once no cycle can still be talking to it: a cycle in flight
            # when the mapping changed ends (one new lastProbeTime), then a whole cycle after it (another)
            for _ in range(2):
                seen = sm(cp, namespace)["status"]["probe"]["lastProbeTime"]
                cluster_support.wait_for(
                    "a probe cycle after the mapping changed",
                    lambda seen=seen: sm(cp, namespace)["status"]["probe"]["lastProbeTime"] != seen,
                    WAIT_S,
                )

        # chat removed and wide (rank 32 over the engines' --max-lora-rank 16) added: chat unloaded from
        # every replica; wide named in AdaptersServing, in the engine's words; the base model serves on
        body["spec"]["adapters"] = declared("sql", "poet", "wide")
        apply(cp, namespace, body)
        obj = adapters_serving("2/3", sql="3/3", poet="3/3", wide="0/3")
        cluster_support.wait_for(
            "chat unloaded everywhere", lambda: all(listed(s) == ["poet", "sql"] for s in sims), WAIT_S
        )
        wide = adapters_of(obj)["wide"]
        assert (wide["serving"], wide["reason"]) == ("False", "AdapterLoadFailed")
        assert "LoRA rank 32 is greater than max_lora_rank 16" in wide["message"]
        assert "chat" not in adapters_of(obj)
        cond = condition(obj, "AdaptersServing")
        assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed")
        assert cond["message"].startswith("wide: AdapterLoadFailed")
        assert condition(obj, "Serving")["status"] == "True"
        assert obj["status"]["probe"]["serving"] == "3/3"
        table = cp.kubectl("get", "sm", "-n", namespace).stdout.splitlines()
        print("\n".join(table))
        assert column(table, "ADAPTERS") == "2/3", table
        described = cp.kubectl("describe", "sm", "qwen", "-n", namespace).stdout
        assert "AdaptersServing" in described
        cluster_support.wait_for(
            "a Warning Event naming wide",
            lambda: "wide: AdapterLoadFailed" in cp.kubectl("get", "events", "-n", namespace).stdout,
            WAIT_S,
        )
