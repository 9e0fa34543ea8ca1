"""Histograms, counters and gauges with a label set per ServedModel, at a small cost per series.

prometheus_client's Histogram keeps, per label set, a child object and one value object with its own lock
per bucket: about 2.5 KB for a 13-bucket series, 40 KB per ServedModel with the probe's three latency
histograms and the seven cold-start stages (measured with tracemalloc; the largest share of the operator's
memory per ServedModel at 1,000). Here a label set is one array of doubles (the bucket counts, then the
sum) under one lock per histogram, and the exposition is built when Prometheus scrapes: the same
`_bucket` / `_sum` / `_count` samples, without prometheus_client's optional `_created` sample.
Counters and gauges the same way: one float per label set in a dict under the family's lock (a
prometheus_client child is ~0.7 KB: its object, a value with its own lock, a counter's created time).

Each family also writes its own text exposition (`chunks()`: the lines prometheus_client's
generate_latest writes for it, byte for byte, in pieces), without a Sample object per line: at 1,000
ServedModels the generic path took ~1.5 s of CPU per scrape, holding the GIL the probe's thread times
streams with.
`Registry.exposition_chunks` serves a registry that way, piece by piece (handlers/metrics.py).
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

SERIES_PER_CHUNK = 256  # label sets per piece of a streamed exposition: ~600 KB of a 15-line histogram's


def _escape(value: str) -> str:
    """A label value as the text format writes it (prometheus_client's openmetrics._escape)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _go(value: float) -> str:
    """A sample value as Go (and generate_latest) writes it: 1.0, 1e+06, +Inf."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _help(name: str, documentation: str, kind: str) -> str:
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """`k="v",…` sorted by label name, as generate_latest writes them."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(zip(names, values, strict=True)))


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

    def chunks(self, per: int = SERIES_PER_CHUNK) -> Iterator[str]:
        """This family's lines in the text format, as generate_latest writes them from collect(), in
        pieces of `per` label sets each, the help lines first."""
        with self._lock:  # a copy of each array: 8 bytes a bucket, the lock held for the copy only
            series = [(key, counts[:]) for key, counts in self._series.items()]
        name = self.name
        yield _help(name, self.documentation, "histogram")
        # `le` sorts among the label names: the labels before it and after it, joined once per series.
        ordered = sorted((*self.labelnames, "le"))
        cut = ordered.index("le")
        les = [f'le="{le}"' for le in self._le]
        for start in range(0, len(series), per):
            out: list[str] = []
            for key, counts in series[start : start + per]:
                pairs = sorted(zip(self.labelnames, key, strict=True))
                before = "".join(f'{k}="{_escape(v)}",' for k, v in pairs[:cut])
                after = "".join(f',{k}="{_escape(v)}"' for k, v in pairs[cut:])
                running = 0.0
                for le, n in zip(les, counts, strict=False):  # counts ends with the sum
                    running += n
                    out.append(f"{name}_bucket{{{before}{le}{after}}} {_go(running)}\n")
                plain = _labels(self.labelnames, key)
                out.append(f"{name}_count{{{plain}}} {_go(running)}\n")
                out.append(f"{name}_sum{{{plain}}} {_go(counts[-1])}\n")
            yield "".join(out)

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

    _suffix, _kind = "", "untyped"  # the exposed sample's name after the family's, its TYPE

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

    def chunks(self, per: int = SERIES_PER_CHUNK) -> Iterator[str]:
        """This family's lines in the text format, as generate_latest writes them from collect(), in
        pieces of `per` label sets each, the help lines first."""
        series, sample, labels = self._snapshot(), self.name + self._suffix, self.labelnames
        yield _help(sample, self.documentation, self._kind)
        for start in range(0, len(series), per):
            yield "".join(
                f"{sample}{{{_labels(labels, k)}}} {_go(v)}\n" for k, v in series[start : start + per]
            )


class LabeledCounter(_LabeledValues):
    """A counter family: `labels(*values).inc(n)` as prometheus_client's, exposed as `<name>_total`."""

    _suffix, _kind = "_total", "counter"

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

    _kind = "gauge"

    def labels(self, *values: str) -> GaugeValue:
        return GaugeValue(self, self._key(values))

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, value in self._snapshot():
            family.add_metric(list(key), value)
        yield family


FastFamily = LabeledHistogram | LabeledCounter | LabeledGauge


class _Others:
    """The registry's collectors but these families, for generate_latest (it only calls collect())."""

    def __init__(self, collectors: list[Collector]) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for c in self.collectors:
            yield from c.collect()


class Registry(CollectorRegistry):
    """A CollectorRegistry that knows its collectors in order, so `exposition_chunks` can write this module's
    families through their own text() and the rest through prometheus_client's generate_latest."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self._ordered: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self._ordered.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self._ordered.remove(collector)

    def exposition_chunks(self, names: set[str] | None = None) -> Iterator[bytes]:
        """The text format (0.0.4) of every collector (of the families in `names`: a scrape's name[]),
        prometheus_client's collectors first, in pieces for a server to send as they come: at 10,000
        ServedModels the whole text is ~165 MB, and built in one piece it was held two and three times over
        (the families' strings, their join, its encoding) at each scrape, the operator's peak memory."""
        collectors = list(self._ordered)
        fast = [c for c in collectors if isinstance(c, FastFamily)]
        others: Collector = _Others([c for c in collectors if not isinstance(c, FastFamily)])
        if names is not None:
            rest = [n for n in names if not any(_owns(f, n) for f in fast)]
            others = self.restricted_registry(rest) if rest else _Others([])
            fast = [f for f in fast if any(_owns(f, n) for n in names)]
        yield generate_latest(others)
        for family in fast:
            for chunk in family.chunks():
                yield chunk.encode()


def _owns(family: FastFamily, sample_name: str) -> bool:
    """Whether a sample name (a scrape's name[]) is one of the family's."""
    if isinstance(family, LabeledHistogram):
        suffixes: tuple[str, ...] = ("", "_bucket", "_count", "_sum")
    elif isinstance(family, LabeledCounter):
        suffixes = ("", "_total")
    else:
        suffixes = ("",)
    return any(sample_name == family.name + s for s in suffixes)
