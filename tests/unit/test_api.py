"""The pydantic API models: samples parse, invalid specs are refused naming the field, defaults agree
with the CRD's (what the API server would fill in), wire names are camelCase."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from servedmodel.api import ServedModel, ServedModelSpec, ServedModelStatus, names
from servedmodel.api.base import to_camel
from servedmodel.api.crd import open_api_schema

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
INVALID = yaml.safe_load((ROOT / "tests" / "golden" / "invalid_crs.yaml").read_text())
BASE_SPEC = {"model": "Qwen/Qwen2.5-7B-Instruct"}


def invalid_body(case: dict[str, Any]) -> dict[str, Any]:
    spec = dict(BASE_SPEC)
    for key, value in (case.get("spec") or {}).items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": case.get("name", "qwen")},
        "spec": spec,
    }


def test_at_least_fifteen_invalid_cases() -> None:
    assert len(INVALID) >= 15
    assert len({c["case"] for c in INVALID}) == len(INVALID)


def test_base_of_invalid_cases_is_valid() -> None:
    cr = ServedModel.model_validate(invalid_body({"case": "base"}))
    assert cr.spec.model == BASE_SPEC["model"]


@pytest.mark.parametrize("case", INVALID, ids=[c["case"] for c in INVALID])
def test_invalid_spec_rejected_naming_the_field(case: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        ServedModel.model_validate(invalid_body(case))
    words = [".".join(str(p) for p in e["loc"]) + " " + e["msg"] for e in info.value.errors()]
    field = case["field"]
    short = field.removeprefix("spec.")
    assert any(field in w or short in w for w in words), words


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_samples_parse(path: Path) -> None:
    cr = ServedModel.model_validate(yaml.safe_load(path.read_text()))
    assert cr.kind == "ServedModel"
    assert len(cr.name) <= 56


def _apply_crd_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """What the API server's structural defaulting does: fill `default` of absent properties, recursively."""
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = _apply_crd_defaults(sub, obj[key])
    elif isinstance(obj, list) and "items" in schema:
        return [_apply_crd_defaults(schema["items"], item) for item in obj]
    return obj


def _subset(small: Any, big: Any, path: str = "") -> list[str]:
    """Paths where `small` (CRD-defaulted) disagrees with `big` (pydantic-defaulted)."""
    if isinstance(small, dict):
        if not isinstance(big, dict):
            return [path]
        return [p for k, v in small.items() for p in _subset(v, big.get(k), f"{path}.{k}")]
    return [] if small == big else [f"{path}: {small!r} != {big!r}"]


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "m"},
        {"model": "m", "engine": {}, "resources": {}, "expose": {}, "monitoring": {}},
        {"model": "m", "probe": {"metricsSource": {}, "slo": {"ttftMs": 500}}},
        {"model": "m", "engine": {"kind": "simulator"}, "resources": {"gpus": 0}},
    ],
)
def test_crd_defaults_agree_with_pydantic(spec: dict[str, Any]) -> None:
    schema = open_api_schema()["properties"]["spec"]
    by_server = _apply_crd_defaults(schema, copy.deepcopy(spec))
    by_model = ServedModelSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert _subset(by_server, by_model) == []
    # And pydantic accepts what the server would store.
    assert ServedModelSpec.model_validate(by_server) == ServedModelSpec.model_validate(spec)


@pytest.mark.parametrize(
    ("snake", "camel"),
    [
        ("hf_token_secret_ref", "hfTokenSecretRef"),
        ("e2e_ms", "e2eMs"),
        ("ttft_p50_ms", "ttftP50Ms"),
        ("gpu_memory_utilization", "gpuMemoryUtilization"),
        ("model", "model"),
    ],
)
def test_camel_case_wire_names(snake: str, camel: str) -> None:
    assert to_camel(snake) == camel


@pytest.mark.parametrize(
    ("spec", "served"),
    [
        ({"model": "Qwen/Qwen2.5-7B-Instruct"}, "Qwen/Qwen2.5-7B-Instruct"),
        ({"model": "Qwen/Qwen2.5-7B-Instruct", "servedModelName": "qwen"}, "qwen"),
        ({"model": "pvc://weights/qwen/Qwen2.5-7B-Instruct"}, "Qwen2.5-7B-Instruct"),
        ({"model": "pvc://weights/qwen/"}, "qwen"),
        ({"model": "pvc://weights"}, "weights"),
        ({"model": "gpt2"}, "gpt2"),
    ],
)
def test_resolved_served_model_name(spec: dict[str, Any], served: str) -> None:
    assert ServedModelSpec.model_validate(spec).resolved_served_model_name == served


def test_external_mode_may_carry_an_api_key() -> None:
    spec = ServedModelSpec.model_validate(
        {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "endpoint": "https://qwen.example.com/",
            "engine": {"apiKeySecretRef": {"name": "qwen-key", "key": "key"}},
        }
    )
    assert spec.external


def test_quantities_accept_numbers_as_yaml_gives_them() -> None:
    spec = ServedModelSpec.model_validate(
        {"model": "m", "resources": {"requests": {"cpu": 4, "memory": "8Gi"}}}
    )
    assert spec.resources.requests is not None
    assert spec.resources.requests.cpu == "4"


def test_status_round_trip_leaves_unset_fields_out() -> None:
    status = ServedModelStatus.model_validate(
        {
            "phase": "Ready",
            "ready": "1/1",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Available"}],
            "probe": {"client": {"ttftMs": 12.5}},
        }
    )
    wire = status.model_dump(by_alias=True, exclude_none=True)
    assert wire["probe"]["client"] == {"ttftMs": 12.5}
    assert "observedGeneration" not in wire
    assert [c.type for c in status.conditions or []] == ["Ready"]


def test_body_round_trip_ignores_server_metadata() -> None:
    body = invalid_body({"case": "x"})
    body["metadata"].update({"uid": "u", "managedFields": [{"manager": "kubectl"}], "generation": 3})
    cr = ServedModel.from_body(body)
    assert cr.metadata.generation == 3
    assert cr.spec.model == BASE_SPEC["model"]


@pytest.mark.parametrize("name", ["vllm", "qwen", "a", "x" * 56])
def test_children_names_are_never_vllm_and_fit_a_dns_label(name: str) -> None:
    assert names.service_name(name) != "vllm"
    assert len(names.service_name(name)) <= 63
    assert names.selector_string(name) == (
        f"app.kubernetes.io/component=engine,app.kubernetes.io/instance={name},app.kubernetes.io/name=servedmodel"
    )
    assert set(names.selector_labels(name).items()) <= set(names.standard_labels(name, "vllm").items())
