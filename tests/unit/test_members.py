"""Probe sharding's arithmetic (k8s/members.py): rendezvous hashing gives every key one owner, the same
on every replica, and a new replica takes only its share; a member whose Lease stops changing is dropped
after one lease duration on this replica's clock (the real Leases: tests/cluster/test_probe_sharding.py)."""

from __future__ import annotations

from typing import Any

from servedmodel.k8s.members import Membership, owner

KEYS = [f"ns/m{i}" for i in range(3000)]


def test_each_key_has_one_owner_and_a_new_member_takes_only_its_share() -> None:
    two = {k: owner(["a", "b"], k) for k in KEYS}
    assert owner(["b", "a"], "ns/m1") == two["ns/m1"]  # the order of the list does not matter
    shares = [sum(1 for o in two.values() if o == m) for m in ("a", "b")]
    assert min(shares) > 0.4 * len(KEYS), shares
    three = {k: owner(["a", "b", "c"], k) for k in KEYS}
    moved = [k for k in KEYS if two[k] != three[k]]
    assert all(three[k] == "c" for k in moved)  # only the newcomer gains; nothing moves between a and b
    assert 0.25 * len(KEYS) < len(moved) < 0.42 * len(KEYS), len(moved)
    assert owner([], "ns/m1") is None


def lease(holder: str, renew: str) -> dict[str, Any]:
    return {"metadata": {"name": f"l-{holder}"}, "spec": {"holderIdentity": holder, "renewTime": renew}}


def test_a_member_whose_lease_stops_changing_is_dropped_after_a_lease_duration() -> None:
    now = [0.0]
    m = Membership(None, "ops", "g", "me", lease_duration_s=12.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert not m.owns("ns/m1")  # before the first list: nothing (no double work)
    m._refresh([lease("me", "t0"), lease("other", "t0")])
    assert m.members() == ["me", "other"]
    now[0] = 10.0
    m._refresh([lease("me", "t1"), lease("other", "t0")])  # other's record unchanged for 10 s: alive
    assert m.members() == ["me", "other"]
    now[0] = 13.0
    assert m._refresh([lease("me", "t2"), lease("other", "t0")]) == []
    assert m.members() == ["me"]
    assert all(m.owns(k) for k in KEYS[:50])
    now[0] = 200.0
    assert m._refresh([lease("me", "t3"), lease("other", "t0")]) == ["l-other"]  # long dead: delete it
