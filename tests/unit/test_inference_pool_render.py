"""spec.inferencePool: what render makes of it with and without the Gateway API Inference Extension's
APIs discovered, the pods' pool label, joining another ServedModel's pool, and the spec's own rules."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from servedmodel.api import ServedModel, names
from servedmodel.render import RenderContext, deployment, render

BOTH = RenderContext(has_inference_pool_api=True, has_inference_objective_api=True)


def cr(pool: dict[str, Any] | None, name: str = "qwen") -> ServedModel:
    spec: dict[str, Any] = {"model": "Qwen/Qwen2.5-7B-Instruct"}
    if pool is not None:
        spec["inferencePool"] = pool
    return ServedModel.model_validate(
        {"metadata": {"name": name, "namespace": "ai", "uid": "u"}, "spec": spec}
    )


def kinds(objs: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objs]


def pod_labels(obj: ServedModel) -> dict[str, str]:
    labels: dict[str, str] = deployment(obj, BOTH)["spec"]["template"]["metadata"]["labels"]
    return labels


PICKER = {"endpointPickerRef": {"name": "epp"}}


@pytest.mark.parametrize(
    ("ctx", "expected"),
    [
        (RenderContext(), []),
        (RenderContext(has_inference_pool_api=True), ["InferencePool"]),
        (BOTH, ["InferencePool", "InferenceObjective"]),
        # No InferencePool API: no objective either (it would name a pool that cannot exist).
        (RenderContext(has_inference_objective_api=True), []),
    ],
)
def test_rendered_only_where_discovered(ctx: RenderContext, expected: list[str]) -> None:
    objs = render(cr({**PICKER, "objective": {"priority": 1}}), ctx)
    assert [k for k in kinds(objs) if k.startswith("Inference")] == expected


def test_pool_selects_the_pool_label_the_pods_carry() -> None:
    obj = cr(PICKER)
    pool = next(o for o in render(obj, BOTH) if o["kind"] == "InferencePool")
    assert pool["metadata"]["name"] == "qwen"
    assert pool["spec"]["selector"] == {"matchLabels": {names.INFERENCE_POOL_LABEL: "qwen"}}
    assert pool["spec"]["targetPorts"] == [{"number": names.ENGINE_PORT}]
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}
    assert pod_labels(obj)[names.INFERENCE_POOL_LABEL] == "qwen"
    # The Deployment's selector stays as it was (immutable): the pool label is on the template only.
    assert names.INFERENCE_POOL_LABEL not in deployment(obj, BOTH)["spec"]["selector"]["matchLabels"]


def test_without_a_pool_no_label() -> None:
    assert names.INFERENCE_POOL_LABEL not in pod_labels(cr(None))
    assert "InferencePool" not in kinds(render(cr(None), BOTH))


def test_joining_a_pool_labels_the_pods_and_renders_no_pool() -> None:
    obj = cr({"name": "shared", "create": False}, name="qwen-b")
    assert pod_labels(obj)[names.INFERENCE_POOL_LABEL] == "shared"
    assert not [k for k in kinds(render(obj, BOTH)) if k.startswith("Inference")]


@pytest.mark.parametrize(
    "pool",
    [
        {},  # creating needs an endpoint picker
        {"create": False, "endpointPickerRef": {"name": "epp"}},
        {"create": False, "objective": {"priority": 1}},
        {**PICKER, "name": "Not_A_Label"},
    ],
)
def test_refused(pool: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        cr(pool)


def test_external_mode_refuses_a_pool() -> None:
    with pytest.raises(pydantic.ValidationError, match="inferencePool"):
        ServedModel.model_validate(
            {
                "metadata": {"name": "ext", "namespace": "ai"},
                "spec": {"model": "m", "endpoint": "http://10.0.0.1:8000", "inferencePool": PICKER},
            }
        )
