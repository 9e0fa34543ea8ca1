"""prober/series.LabeledHistogram against prometheus_client's own Histogram: the same observations give
the same `_bucket` / `_sum` / `_count` samples (prometheus_client's optional `_created` aside), read back
with prometheus_client's parser; a deleted ServedModel's series go."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servedmodel.prober.series import LabeledHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
VALUES = (0.0, 0.005, 0.0051, 0.3, 1.0, 7.5, 60.0, 61.0, 1e6)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_the_same_samples_as_prometheus_clients_histogram() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a = LabeledHistogram("x_seconds", "X.", ["namespace", "name"], BUCKETS, ours)
    b = Histogram("x_seconds", "X.", ["namespace", "name"], buckets=BUCKETS, registry=theirs)
    for i, v in enumerate(VALUES):
        for h in (a, b):
            h.labels("ns", f"m{i % 3}").observe(v)
    got, want = samples(ours), samples(theirs)
    assert got == want
    assert len(got) == 3 * (len(BUCKETS) + 1 + 2)  # three label sets: buckets, +Inf, _sum, _count
    assert "# TYPE x_seconds histogram" in generate_latest(ours).decode()


def test_a_deleted_servedmodels_series_go_and_others_stay() -> None:
    registry = CollectorRegistry()
    h = LabeledHistogram("cold_seconds", "C.", ["namespace", "name", "stage"], (1.0, 10.0), registry)
    for stage in ("scheduled", "total"):
        h.labels("ns", "a", stage).observe(2.0)
        h.labels("ns", "b", stage).observe(2.0)
    h.remove_matching(("ns", "a"))
    left = {labels for (name, labels) in samples(registry) if name == "cold_seconds_count"}
    assert left == {(("name", "b"), ("namespace", "ns"), ("stage", s)) for s in ("scheduled", "total")}
    assert 'name="a"' not in generate_latest(registry).decode()


def test_the_label_count_is_checked() -> None:
    h = LabeledHistogram("y_seconds", "Y.", ["namespace", "name"], (1.0,), CollectorRegistry())
    with pytest.raises(ValueError, match="2 label values expected, got 1"):
        h.labels("ns")
