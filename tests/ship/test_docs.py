"""The shipping docs point at things that exist: every repository path they name, every sample, every
alert in the operations table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "docs" / n for n in ("architecture.md", "operations.md", "benchmarks.md", "install-snippet.md")
]
PATH = re.compile(r"(?<![\w/.-])((?:manifests|crds|hack|images|bench|tests|operator|docs)/[\w./-]*[\w/])")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_named_paths_exist(doc: Path) -> None:
    text = doc.read_text()
    named = {m.rstrip("/.") for m in PATH.findall(text)}
    assert named, f"{doc.name} names no repository path"
    missing = sorted(p for p in named if not (ROOT / p).exists() and "<" not in p)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_operations_lists_every_alert() -> None:
    rule = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus_rule.yaml").read_text())
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    text = (ROOT / "docs" / "operations.md").read_text()
    # The table abbreviates pairs ("ServedModelProbeTTFTAboveSLO / TPOTAboveSLO").
    missing = [
        a
        for a in alerts
        if a not in text
        and a.removeprefix("ServedModelProbe").removeprefix("VLLM").removeprefix("ServedModel") not in text
    ]
    assert not missing, f"alerts not documented in docs/operations.md: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    # install-snippet.md is README text: its links are relative to the repository root.
    base = ROOT if doc.name == "install-snippet.md" else doc.parent
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text())
    broken = [link for link in links if not (base / link).exists()]
    assert not broken, f"{doc.name}: broken links {broken}"
