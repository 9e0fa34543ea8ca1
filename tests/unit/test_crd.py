"""The generated CRD: checked-in copies are current, the schema is structural, CEL rules are costable,
printer columns and the scale subresource point at fields that exist."""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from servedmodel.api import crd as crd_mod
from servedmodel.api.crd import CRD_FILE, SchemaError, crd, crd_yaml, reference_markdown, structural

ROOT = Path(__file__).resolve().parents[2]
Node = dict[str, Any]


def _nodes(node: Node, path: str = "") -> Iterator[tuple[str, Node]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}.*")


def _schema() -> Node:
    schema: Node = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_checked_in_crd_is_current() -> None:
    assert (ROOT / CRD_FILE).read_text() == crd_yaml(), "run `make crd`"


def test_checked_in_reference_is_current() -> None:
    assert (ROOT / "docs" / "reference.md").read_text() == reference_markdown(), (
        "run `servedmodel crd --markdown > docs/reference.md`"
    )


def test_generation_is_deterministic() -> None:
    assert crd_yaml() == crd_yaml()
    assert reference_markdown() == reference_markdown()


@pytest.mark.parametrize(
    ("flag", "expect"), [(False, "kind: CustomResourceDefinition"), (True, "# ServedModel")]
)
def test_cli_prints(flag: bool, expect: str) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert crd_mod.main(argparse.Namespace(markdown=flag)) == 0
    assert expect in out.getvalue()


def test_schema_is_structural() -> None:
    for path, node in _nodes(_schema()):
        assert not {"$ref", "$defs", "title"} & node.keys(), path
        assert node.get("additionalProperties") is not False, path
        assert not ("properties" in node and "additionalProperties" in node), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
        else:
            assert "type" in node, path
        assert "nullable" not in node, path


def test_every_field_is_described() -> None:
    undocumented = [
        path
        for path, node in _nodes(_schema())
        if path
        and path != ".metadata"
        and not path.endswith(("[]", ".*"))  # list items and map values: the field describes them
        and not node.get("description")
    ]
    assert undocumented == []


def test_cel_rules_are_on_bounded_lists_and_strings() -> None:
    # The API server refuses CEL whose estimated cost is unbounded: lists a rule walks need maxItems,
    # their strings maxLength.
    for path, node in _nodes(_schema()):
        if node.get("type") == "array" and node.get("x-kubernetes-validations"):
            assert "maxItems" in node, path
            for sub_path, sub in _nodes(node["items"], path + "[]"):
                if sub.get("type") == "string" and "enum" not in sub:
                    assert "maxLength" in sub, sub_path


def test_root_and_spec_rules() -> None:
    schema = _schema()
    assert any("metadata.name" in r["rule"] for r in schema["x-kubernetes-validations"])
    spec_rules = " ".join(r["message"] for r in schema["properties"]["spec"]["x-kubernetes-validations"])
    for words in ("multiple of engine.tensorParallelSize", "endpoint (external mode)", "revision"):
        assert words in spec_rules


def _resolve(path: str) -> Node | None:
    node: Node | None = _schema()
    for part in path.strip(".").split("."):
        if node is None or part not in node.get("properties", {}):
            return None
        node = node["properties"][part]
    return node


def test_printer_columns_point_at_fields() -> None:
    version = crd()["spec"]["versions"][0]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Model", "Ready", "Phase", "TTFT", "TPOT", "Running", "Waiting", "Age"):
        assert wanted in names
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"] != ".metadata.creationTimestamp":
            node = _resolve(column["jsonPath"])
            assert node is not None, column
            assert node["type"] == column["type"] or (column["type"], node["type"]) == ("number", "integer")


def test_scale_subresource_and_status() -> None:
    version = crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert version["subresources"]["status"] == {}
    assert _resolve(scale["specReplicasPath"]) == _resolve(".spec.replicas")
    assert _resolve(scale["statusReplicasPath"])["type"] == "integer"  # type: ignore[index]
    assert _resolve(scale["labelSelectorPath"])["type"] == "string"  # type: ignore[index]


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    conditions = _resolve(".status.conditions")
    assert conditions is not None
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]


def test_names_and_scope() -> None:
    doc = yaml.safe_load(crd_yaml())
    assert doc["metadata"]["name"] == "servedmodels.inference.servedmodel.io"
    assert doc["spec"]["scope"] == "Namespaced"
    assert doc["spec"]["names"]["shortNames"] == ["sm"]


def test_exclusive_bound_written_the_openapi_v3_way() -> None:
    node = _resolve(".spec.engine.gpuMemoryUtilization")
    assert node == node | {"minimum": 0, "exclusiveMinimum": True, "maximum": 1}  # type: ignore[operator]


@pytest.mark.parametrize(
    ("node", "expect"),
    [
        ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}, {"type": "integer"}),
        ({"const": "x", "type": "string"}, {"type": "string", "enum": ["x"]}),
        (
            {"type": "object", "additionalProperties": True},
            {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        ),
        ({"$ref": "#/$defs/A", "description": "field"}, {"description": "field", "type": "string"}),
    ],
)
def test_structural_rewrites(node: Node, expect: Node) -> None:
    assert structural(node, {"A": {"type": "string", "description": "model", "title": "A"}}) == expect


@pytest.mark.parametrize(
    "node",
    [
        {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        {"description": "no type"},
    ],
)
def test_structural_refuses_what_the_api_server_would(node: Node) -> None:
    with pytest.raises(SchemaError):
        structural(node, {})
