"""`servedmodel crd`: the ServedModel CRD (or its Markdown reference) generated from the pydantic models.

pydantic writes JSON Schema 2020-12 with $defs/$ref and `anyOf [X, null]` for optionals; the API server
wants a structural OpenAPI v3 schema. `structural()` inlines every $ref, turns optionals into plain
optional fields, drops titles and `additionalProperties: false`, rewrites exclusive bounds the OpenAPI v3.0
way, and keeps descriptions, defaults, enums, bounds, patterns and the x-kubernetes-* extensions the
models carry in json_schema_extra. The output is deterministic: same models → byte-identical YAML.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from .base import API_GROUP, API_VERSION, KIND, PLURAL, SHORT_NAMES, SINGULAR
from .model import ServedModel
from .spec import ServedModelSpec
from .status import ServedModelStatus

CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"crds/{API_GROUP}_{PLURAL}.yaml"
Schema = dict[str, Any]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model", "description": "Model served."},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": ".status.ready",
        "description": "Ready/total engine replicas.",
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
    {
        "name": "Serving",
        "type": "string",
        "jsonPath": ".status.probe.serving",
        "description": "Replicas whose own probe completed a real chat request / replicas probed.",
    },
    {
        "name": "TTFT",
        "type": "number",
        "jsonPath": ".status.probe.client.ttftMs",
        "description": "Last probe's TTFT (request sent → first content token), ms.",
    },
    {
        "name": "TPOT",
        "type": "number",
        "jsonPath": ".status.probe.client.tpotMs",
        "description": "Last probe's TPOT ((e2e - TTFT)/(completion tokens - 1)), ms.",
    },
    {
        "name": "Running",
        "type": "integer",
        "jsonPath": ".status.probe.scheduler.running",
        "description": "Requests in the running batch at probe time.",
    },
    {
        "name": "Waiting",
        "type": "integer",
        "jsonPath": ".status.probe.scheduler.waiting",
        "description": "Requests waiting in the queue at probe time.",
    },
    {
        "name": "Adapters",
        "type": "string",
        "jsonPath": ".status.probe.adaptersServing",
        "description": "LoRA adapters whose own probe served / adapters declared (spec.adapters).",
    },
    {
        "name": "KV",
        "type": "number",
        "jsonPath": ".status.probe.scheduler.kvCacheUsage",
        "description": "KV cache usage (0..1) at probe time.",
        "priority": 1,
    },
    {
        "name": "Rollout",
        "type": "string",
        "jsonPath": ".status.rollout.state",
        "description": "The newest engine revision through its readiness gates: Proving, Proven, Blocked, "
        "RolledBack (status.rollout has the pod and the check).",
        "priority": 1,
    },
    {
        "name": "Desired",
        "type": "integer",
        "jsonPath": ".status.autoscaling.desiredReplicas",
        "description": "Replicas the autoscaler asks for (spec.autoscaling; status.autoscaling has the "
        "rest).",
        "priority": 1,
    },
    {
        "name": "Endpoint",
        "type": "string",
        "jsonPath": ".status.endpoint",
        "description": "Base URL of the OpenAI-compatible API.",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# Keys that lead each schema node, for a YAML that reads top-down; the rest follow sorted.
_KEY_ORDER = ("description", "type", "format", "default", "enum", "required", "properties", "items")
_DROP = {"title", "$defs"}


class SchemaError(ValueError):
    """A model produced a schema the API server would not accept as structural."""


def _merge(base: Schema, extra: Schema) -> Schema:
    """Field-level keys (description, default, CEL rules) over the referenced model's own."""
    out = dict(base)
    for key, value in extra.items():
        if key == "x-kubernetes-validations" and key in out:
            out[key] = [*out[key], *value]
        else:
            out[key] = value
    return out


def _ordered(node: Schema) -> Schema:
    head = [k for k in _KEY_ORDER if k in node]
    tail = sorted(k for k in node if k not in _KEY_ORDER)
    return {k: node[k] for k in head + tail}


def structural(node: Schema, defs: dict[str, Schema], path: str = "") -> Schema:
    """One pydantic JSON Schema node → a structural OpenAPI v3 node (recursively)."""
    node = {k: v for k, v in node.items() if k not in _DROP}
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        return structural(_merge(target, node), defs, path)
    if "allOf" in node and len(node["allOf"]) == 1:
        return structural(_merge(node.pop("allOf")[0], node), defs, path)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v != {"type": "null"}]
        if node.get("x-kubernetes-int-or-string"):
            pass  # Kubernetes' own int-or-string shape: anyOf [integer, string] stays.
        elif len(variants) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if rest.get("default", 0) is None:
                del rest["default"]
            return structural(_merge(variants[0], rest), defs, path)
        else:
            raise SchemaError(f"{path or '<root>'}: a union of several types is not structural")
    if "default" in node and node["default"] is None:
        del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
            node[plain] = node[bound]
            node[bound] = True
    if "properties" in node:
        node.pop("additionalProperties", None)
        node["properties"] = {
            name: structural(sub, defs, f"{path}.{name}") for name, sub in node["properties"].items()
        }
        if not node.get("required"):
            node.pop("required", None)
    elif node.get("type") == "object":
        extra = node.pop("additionalProperties", True)
        if isinstance(extra, dict) and extra:
            node["additionalProperties"] = structural(extra, defs, f"{path}.*")
        elif not node.get("x-kubernetes-preserve-unknown-fields"):
            node["x-kubernetes-preserve-unknown-fields"] = True
    if "items" in node:
        node["items"] = structural(node["items"], defs, f"{path}[]")
    if (
        "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        raise SchemaError(f"{path or '<root>'}: no type (not structural)")
    return _ordered(node)


def _pydantic_schema() -> tuple[Schema, dict[str, Schema]]:
    schema = ServedModel.model_json_schema(by_alias=True, mode="validation")
    return schema, schema.pop("$defs", {})


def open_api_schema() -> Schema:
    """The openAPIV3Schema of the CRD."""
    schema, defs = _pydantic_schema()
    props = schema["properties"]
    root: Schema = {
        "description": schema.get("description", ""),
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "description": "APIVersion of this object (inference.servedmodel.io/v1alpha1).",
                "type": "string",
            },
            "kind": {"description": "Kind of this object (ServedModel).", "type": "string"},
            # The API server owns metadata's schema; a CRD may only say it is an object.
            "metadata": {"type": "object"},
            "spec": structural(props["spec"], defs, ".spec"),
            "status": structural(props["status"], defs, ".status"),
        },
        "x-kubernetes-validations": schema["x-kubernetes-validations"],
    }
    return _ordered(root)


def crd() -> Schema:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "servedmodel", "app.kubernetes.io/part-of": "servedmodel"},
        },
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": open_api_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Shared sub-schemas are written out in full: no &anchors/*aliases in a CRD."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(obj: Any) -> str:
    """Deterministic YAML (insertion order, no aliases) shared by the CRD and rendered objects."""
    return yaml.dump(obj, Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True, width=110)


def crd_yaml() -> str:
    header = "# Generated by `servedmodel crd` from operator/servedmodel/api (make crd). Do not edit.\n"
    return header + dump_yaml(crd())


# ---- Markdown reference -------------------------------------------------------------------------


def _type_of(node: Schema) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "quantity (int or string)"
    kind = str(node.get("type", "object"))
    if kind == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if kind == "object" and "additionalProperties" in node:
        return f"map[string]{_type_of(node['additionalProperties'])}"
    return kind


def _constraints(node: Schema) -> str:
    parts: list[str] = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, sign in (("minimum", "≥"), ("maximum", "≤")):
        if key in node:
            strict = node.get(f"exclusive{key[:1].upper()}{key[1:]}") is True
            parts.append(f"{'>' if strict and sign == '≥' else '<' if strict else sign} {node[key]}")
    for key, word in (("minLength", "min length"), ("maxLength", "max length"), ("maxItems", "max items")):
        if key in node:
            parts.append(f"{word} {node[key]}")
    if "pattern" in node and not node.get("x-kubernetes-int-or-string"):
        parts.append(f"pattern `{node['pattern']}`")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _object_sections(node: Schema, path: str, out: list[str]) -> None:
    props: dict[str, Schema] = node.get("properties", {})
    required = set(node.get("required", []))
    out += [f"### `{path}`", "", _cell(node.get("description", "")), ""]
    out += ["| Field | Type | Default | Constraints | Description |", "|---|---|---|---|---|"]
    nested: list[tuple[str, Schema]] = []
    for name, sub in props.items():
        default = f"`{json.dumps(sub['default'], ensure_ascii=False)}`" if "default" in sub else ""
        flag = " (required)" if name in required else ""
        out.append(
            f"| `{name}`{flag} | {_type_of(sub)} | {_cell(default)} | {_cell(_constraints(sub))} "
            f"| {_cell(sub.get('description', ''))} |"
        )
        target = sub.get("items", sub) if sub.get("type") == "array" else sub
        if "properties" in target:
            nested.append((f"{path}.{name}{'[]' if target is not sub else ''}", target))
    rules = node.get("x-kubernetes-validations", [])
    if rules:
        out += ["", "Rules (checked by the API server):", ""]
        out += [f"- {_cell(r['message'])}" for r in rules]
    out.append("")
    for sub_path, sub in nested:
        _object_sections(sub, sub_path, out)


def reference_markdown() -> str:
    """docs/reference.md: every field of spec and status, generated from the same schema as the CRD."""
    schema = open_api_schema()
    out = [
        "# ServedModel reference",
        "",
        "<!-- Generated by `servedmodel crd --markdown` from operator/servedmodel/api. Do not edit. -->",
        "",
        f"`apiVersion: {API_GROUP}/{API_VERSION}`, `kind: {KIND}` (plural `{PLURAL}`, short name "
        f"`{', '.join(SHORT_NAMES)}`), namespaced, with the `status` and `scale` subresources "
        "(`kubectl scale sm NAME --replicas=N`; refused while `spec.autoscaling` is set: the autoscaler "
        "owns the replicas then).",
        "",
        "Printer columns: " + ", ".join(c["name"] for c in PRINTER_COLUMNS) + ".",
        "",
        "Rules on the object:",
        "",
        *[f"- {_cell(r['message'])}" for r in schema["x-kubernetes-validations"]],
        "",
    ]
    _object_sections(schema["properties"]["spec"], "spec", out)
    _object_sections(schema["properties"]["status"], "status", out)
    return "\n".join(out).rstrip("\n") + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the Markdown field reference (docs/reference.md) instead",
    )


def main(args: argparse.Namespace) -> int:
    sys.stdout.write(reference_markdown() if args.markdown else crd_yaml())
    return 0


__all__ = [
    "CRD_FILE",
    "CRD_NAME",
    "PRINTER_COLUMNS",
    "SchemaError",
    "ServedModelSpec",
    "ServedModelStatus",
    "crd",
    "crd_yaml",
    "open_api_schema",
    "reference_markdown",
    "structural",
]
