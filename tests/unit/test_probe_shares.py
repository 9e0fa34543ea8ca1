"""Probe slots shared out among namespaces (prober/shares.py): sized from demand, max-min fair."""

from __future__ import annotations

import math

import pytest

from servedmodel.prober.shares import demand, fair_shares, mean_cycle_s


def test_demand_is_littles_law_with_a_margin_for_bunched_starts() -> None:
    # 1,000 models every 60 s, 0.34 s cycles: 5.7 in flight on average, 14 with the margin
    assert demand(1000 / 60, 0.34) == pytest.approx(5.67 + 3 * math.sqrt(5.67) + 1, rel=1e-3)
    assert demand(0.0, 1.0) == 1.0  # a namespace with models always gets a slot
    assert demand(2.0, 3.0) > demand(2.0, 1.0) > demand(1.0, 1.0)


def test_a_lone_namespace_gets_every_slot_it_needs() -> None:
    assert fair_shares({"bench": demand(1000 / 60, 0.34)}, 16) == {"bench": 14}
    assert fair_shares({"bench": 400.0}, 16) == {"bench": 16}
    assert fair_shares({"bench": 2.2}, 16) == {"bench": 3}


def test_small_demands_are_met_and_the_rest_split_what_is_left() -> None:
    shares = fair_shares({"hostile": 1e9, "b": 2.5, "c": 1.0}, 16)
    assert shares == {"c": 1, "b": 3, "hostile": 12}
    # four tenants whose engines never answer and one healthy: the healthy one keeps its slots
    shares = fair_shares({"h1": 1e9, "h2": 1e9, "h3": 1e9, "h4": 1e9, "ok": 2.5}, 16)
    assert shares["ok"] == 3
    assert sorted(shares[h] for h in ("h1", "h2", "h3", "h4")) == [3, 3, 3, 4]
    assert sum(shares.values()) == 16


def test_every_namespace_gets_a_slot_when_there_are_more_namespaces_than_slots() -> None:
    shares = fair_shares({f"ns{i}": 5.0 for i in range(40)}, 16)
    assert set(shares.values()) == {1}


def test_mean_cycle_seconds_follow_the_newest_cycles() -> None:
    assert mean_cycle_s(None, 0.4) == 0.4
    mean = 0.4
    for _ in range(30):
        mean = mean_cycle_s(mean, 2.0)
    assert mean == pytest.approx(2.0, abs=0.01)
