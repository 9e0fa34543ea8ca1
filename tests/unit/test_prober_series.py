"""prober/series.LabeledHistogram, LabeledCounter and LabeledGauge against prometheus_client's own
Histogram, Counter and Gauge: the same observations give the same samples (prometheus_client's optional
`_created` aside), read back with prometheus_client's parser; a deleted ServedModel's series go."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servedmodel.prober.series import (
    SERIES_PER_CHUNK,
    LabeledCounter,
    LabeledGauge,
    LabeledHistogram,
    Registry,
)

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


def test_counters_and_gauges_give_prometheus_clients_samples() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    labels = ["namespace", "name", "reason"]
    a_counter = LabeledCounter("x_probes", "X.", labels, ours)
    a_gauge = LabeledGauge("x_serving", "S.", labels[:2], ours)
    b_counter = Counter("x_probes", "X.", labels, registry=theirs)
    b_gauge = Gauge("x_serving", "S.", labels[:2], registry=theirs)
    for i in range(7):
        for c in (a_counter, b_counter):
            c.labels("ns", f"m{i % 3}", "Serving" if i % 2 else "Timeout").inc()
            c.labels("ns", "m0", "Serving").inc(2.5)
        for g in (a_gauge, b_gauge):
            g.labels("ns", f"m{i % 3}").set(i)
            g.labels("ns", "m1").inc()
    assert samples(ours) == samples(theirs)
    text = generate_latest(ours).decode()

    def comments(t: str) -> list[str]:
        return [line for line in t.splitlines() if line.startswith("#") and "_created" not in line]

    assert comments(text) == comments(generate_latest(theirs).decode())  # HELP and TYPE as theirs
    assert 'x_probes_total{name="m0",namespace="ns",reason="Serving"} 18.5' in text


def test_counters_only_go_up_and_a_servedmodels_values_go() -> None:
    registry = CollectorRegistry()
    c = LabeledCounter("y_probes", "Y.", ["namespace", "name", "reason"], registry)
    g = LabeledGauge("y_serving", "S.", ["namespace", "name"], registry)
    with pytest.raises(ValueError, match="only go up"):
        c.labels("ns", "a", "Serving").inc(-1)
    for name in ("a", "b"):
        c.labels("ns", name, "Serving").inc()
        g.labels("ns", name).set(1)
    c.remove_matching(("ns", "a"))
    g.remove("ns", "a")
    text = generate_latest(registry).decode()
    assert 'name="a"' not in text
    assert text.count('name="b"') == 2
    with pytest.raises(ValueError, match="2 label values expected, got 3"):
        g.labels("ns", "a", "x")


def filled_registry() -> tuple[Registry, Counter]:
    """Every kind of family, with label values that need escaping, beside a prometheus_client counter."""
    registry = Registry()
    other = Counter("z_reconciles", "Reconciles.", ["result"], registry=registry)
    other.labels("ok").inc()
    h = LabeledHistogram(
        "x_seconds", 'X "quoted"\nhelp \\.', ["namespace", "name", "stage"], BUCKETS, registry
    )
    c = LabeledCounter("x_probes", "P.", ["namespace", "name", "reason"], registry)
    g = LabeledGauge("x_serving", "S.", ["name", "namespace"], registry)
    for i, v in enumerate(VALUES):
        name = ['m"0', "m\\1", "m\n2"][i % 3]
        h.labels("ns", name, "total").observe(v)
        c.labels("ns", name, "Serving").inc(v)
        g.labels(name, "ns").set(-v if i % 2 else v)
    return registry, other


def test_the_families_own_text_is_generate_latests_byte_for_byte() -> None:
    registry, _ = filled_registry()
    fast = b"".join(registry.exposition_chunks()).decode()
    slow = generate_latest(registry).decode()
    # the same lines; prometheus_client's collectors first (its counter's _created too), then these
    # families in their order
    assert fast.startswith("# HELP z_reconciles_total Reconciles.\n# TYPE z_reconciles_total counter\n")
    assert sorted(b for b in fast.split("# HELP ") if b) == sorted(b for b in slow.split("# HELP ") if b)
    assert not [line for line in fast.splitlines() if line.startswith("x_") and "_created" in line]
    assert 'x_seconds_bucket{le="0.005",name="m\\"0",namespace="ns",stage="total"} 1.0' in fast


def test_a_scrape_for_some_names_gets_only_those() -> None:
    registry, _ = filled_registry()
    only = b"".join(registry.exposition_chunks({"x_seconds_count", "x_probes_total"})).decode()
    assert "# TYPE x_seconds histogram" in only
    assert "# TYPE x_probes_total counter" in only
    assert "x_serving" not in only
    assert "z_reconciles" not in only
    rest = b"".join(registry.exposition_chunks({"z_reconciles_total"})).decode()
    assert rest.startswith("# HELP z_reconciles_total")
    assert "x_" not in rest


def test_the_exposition_comes_in_pieces_of_a_bounded_number_of_series() -> None:
    """At 10,000 ServedModels the text is ~165 MB: a scrape must never hold more than a piece of it. The
    pieces join to the whole text, and none holds more than SERIES_PER_CHUNK label sets."""
    registry = Registry()
    h = LabeledHistogram("x_seconds", "X.", ["namespace", "name"], BUCKETS, registry)
    c = LabeledCounter("x_probes", "P.", ["namespace", "name"], registry)
    g = LabeledGauge("x_serving", "S.", ["namespace", "name"], registry)
    n = 3 * SERIES_PER_CHUNK + 5
    for i in range(n):
        h.labels("ns", f"m{i}").observe(0.3)
        c.labels("ns", f"m{i}").inc()
        g.labels("ns", f"m{i}").set(1)
    pieces = list(registry.exposition_chunks())
    whole = b"".join(pieces).decode()
    slow = generate_latest(registry).decode()
    assert sorted(b for b in whole.split("# HELP ") if b) == sorted(b for b in slow.split("# HELP ") if b)
    assert whole.count('x_seconds_bucket{le="+Inf"') == n
    assert whole.count("x_probes_total{") == n
    assert whole.count("x_serving{") == n
    per_piece = [p.count(b"_count{") + p.count(b"x_probes_total{") + p.count(b"x_serving{") for p in pieces]
    assert max(per_piece) == SERIES_PER_CHUNK
    assert len(pieces) >= 3 * 4  # each family: its help lines, then 4 pieces of series
