"""Histograms, counters and gauges with a label set per ServedModel, at a small cost per series.

prometheus_client's Histogram keeps, per label set, a child object and one value object with its own lock
per bucket: about 2.5 KB for a 13-bucket series, 40 KB per ServedModel with the probe's three latency
histograms and the seven cold-start stages (measured with tracemalloc; the largest share of the operator's
memory per ServedModel at 1,000). Here a label set is one array of doubles (the bucket counts, then the
sum) under one lock per histogram, and the exposition is built when Prometheus scrapes: the same
`_bucket` / `_sum` / `_count` samples, without prometheus_client's optional `_created` sample.
Counters and gauges the same way: one float per label set in a dict under the family's lock (a
prometheus_client child is ~0.7 KB: its object, a value with its own lock, a counter's created time).
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import INF


def le_label(bound: float) -> str:
    """A bucket's `le` as prometheus_client writes it (1.0, 0.005, +Inf) for the bounds used here."""
    return "+Inf" if bound == INF else repr(float(bound))


class Observer:
    """One label set of a LabeledHistogram (what `labels(...)` returns): `observe(seconds)`."""

    __slots__ = ("_histogram", "_key")

    def __init__(self, histogram: LabeledHistogram, key: tuple[str, ...]) -> None:
        self._histogram, self._key = histogram, key

    def observe(self, value: float) -> None:
        self._histogram.observe(self._key, value)


class LabeledHistogram(Collector):
    """A histogram family: `labels(*values).observe(v)` as prometheus_client's, `remove_matching(prefix)`
    to drop a ServedModel's series."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        bounds = sorted(float(b) for b in buckets)
        self.bounds = tuple(bounds if bounds and bounds[-1] == INF else [*bounds, INF])
        self._le = tuple(le_label(b) for b in self.bounds)
        self._series: dict[tuple[str, ...], array[float]] = {}
        self._lock = threading.Lock()  # the probe's thread observes, the scrape's thread collects
        registry.register(self)

    def labels(self, *values: str) -> Observer:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}")
        return Observer(self, tuple(str(v) for v in values))

    def observe(self, key: tuple[str, ...], value: float) -> None:
        i = bisect_left(self.bounds, value)  # the first bucket whose upper bound (le) holds the value
        with self._lock:
            counts = self._series.get(key)
            if counts is None:
                counts = self._series[key] = array("d", bytes(8 * (len(self.bounds) + 1)))
            counts[i] += 1
            counts[-1] += value

    def remove_matching(self, prefix: tuple[str, ...]) -> None:
        """Drop every label set that starts with `prefix` (a deleted ServedModel's: no ghosts)."""
        with self._lock:
            for key in [k for k in self._series if k[: len(prefix)] == prefix]:
                del self._series[key]

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            series = [(key, counts.tolist()) for key, counts in self._series.items()]
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, counts in series:
            running, buckets = 0.0, []
            for le, n in zip(self._le, counts, strict=False):  # counts ends with the sum
                running += n
                buckets.append((le, running))
            family.add_metric(list(key), buckets, sum_value=counts[-1])
        yield family


class Value:
    """One label set of a LabeledCounter or LabeledGauge (what `labels(...)` returns)."""

    __slots__ = ("_family", "_key")

    def __init__(self, family: _LabeledValues, key: tuple[str, ...]) -> None:
        self._family, self._key = family, key

    def inc(self, amount: float = 1.0) -> None:
        self._family.add(self._key, amount)


class GaugeValue(Value):
    __slots__ = ()

    def set(self, value: float) -> None:
        self._family.put(self._key, value)


class _LabeledValues(Collector):
    """One float per label set under one lock; `remove(*labels)` and `remove_matching(prefix)`."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def _key(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}")
        return tuple(str(v) for v in values)

    def add(self, key: tuple[str, ...], amount: float) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def put(self, key: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._values[key] = float(value)

    def remove(self, *values: str) -> None:
        with self._lock:
            self._values.pop(self._key(values), None)

    def remove_matching(self, prefix: tuple[str, ...]) -> None:
        """Drop every label set that starts with `prefix` (a deleted ServedModel's: no ghosts)."""
        with self._lock:
            for key in [k for k in self._values if k[: len(prefix)] == prefix]:
                del self._values[key]

    def _snapshot(self) -> list[tuple[tuple[str, ...], float]]:
        with self._lock:
            return list(self._values.items())


class LabeledCounter(_LabeledValues):
    """A counter family: `labels(*values).inc(n)` as prometheus_client's, exposed as `<name>_total`."""

    def labels(self, *values: str) -> Value:
        return Value(self, self._key(values))

    def add(self, key: tuple[str, ...], amount: float) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up (inc by {amount})")
        super().add(key, amount)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, value in self._snapshot():
            family.add_metric(list(key), value)
        yield family


class LabeledGauge(_LabeledValues):
    """A gauge family: `labels(*values).set(v)` / `.inc(n)` as prometheus_client's."""

    def labels(self, *values: str) -> GaugeValue:
        return GaugeValue(self, self._key(values))

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, value in self._snapshot():
            family.add_metric(list(key), value)
        yield family
