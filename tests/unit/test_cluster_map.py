"""server.cluster.smap.ClusterMap placement: the first holders of many objects at once (the
GetBatch paths) are exactly those of each, per-bucket copies included; leaving, maintenance."""

from __future__ import annotations

from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode


def _map(targets: int) -> ClusterMap:
    nodes = (ClusterNode("gw1", "http://127.0.0.1:1", PROXY),
             *(ClusterNode(f"t{i}", f"http://127.0.0.1:{10 + i}", TARGET) for i in range(targets)))
    return ClusterMap(1, "uuid", "gw1", nodes, "now").with_copies("three", 3).with_copies("one", 1)


def _holders(smap: ClusterMap, objects) -> list[list[ClusterNode]]:
    return [smap.holders(b, o) for b, o in objects]


def test_first_holders_is_the_first_holder_not_skipped():
    """``first_holders`` (a GetBatch window's senders, in NumPy) is, for each object, the first
    of its ``holders`` not skipped, None when every one is: per-bucket copies, skipped targets,
    a leaving target and names of any characters; ``hrw.digests`` is ``digest(uname(...))``."""
    from batchfs.wire import hrw

    names = [f"k/{i}-ü" for i in range(300)] + ["\udcff-surrogate", "", "a" * 1000]
    for smap in (_map(1), _map(2), _map(3), _map(7), _map(4).with_leaving("t2")):
        for objects in ([(b, o) for o in names for b in ("plain", "three", "one")], [("plain", o) for o in names]):
            assert hrw.digests(objects) == [hrw.digest(hrw.uname(b, o)) for b, o in objects]
            for skip in ((), ("t0",), ("t1", "t3"), tuple(smap.targets), ("nobody",)):
                want = [next((n for n in smap.holders(b, o) if n.id not in skip), None) for b, o in objects]
                assert smap.first_holders(objects, skip) == want
    assert _map(3).first_holders([]) == []
    no_targets = ClusterMap(1, "uuid", "gw1", (ClusterNode("gw1", "http://127.0.0.1:1", PROXY),), "now")
    assert no_targets.first_holders([("b", "o")]) == [None]


def test_a_leaving_target_places_nothing_but_is_still_asked():
    """``with_leaving``: HRW ranks the others (as the SDK does, reading the flag from the wire
    map); the leaving target is still a target, last among where a copy is looked for."""
    from batchfs.wire import hrw

    full = _map(4)
    smap = full.with_leaving("t2")
    assert smap.version == full.version + 1 and smap.with_leaving("t2") is smap
    assert set(smap.targets) == {"t0", "t1", "t2", "t3"} and set(smap.placed) == {"t0", "t1", "t3"}
    without = full.without("t2")
    objects = [(b, f"k/{i}") for i in range(300) for b in ("plain", "three", "one")]
    assert _holders(smap, objects) == _holders(without, objects)
    assert all(smap.sources(b, o)[-1].id == "t2" and smap.copies_at(b, o)[-1].id == "t2" for b, o in objects)
    wire = smap.wire()
    assert wire["tmap"]["t2"]["flags"] == hrw.SNODE_DECOMM and wire["tmap"]["t0"]["flags"] == 0
    placed = hrw.smap_targets(wire)  # what the mount's and the SDK's placement rank
    assert set(placed) == {"t0", "t1", "t3"}
    for b, o in objects[:50]:
        assert hrw.owner(hrw.digest(hrw.uname(b, o)), {i: d for i, (d, _) in placed.items()}) == smap.owner(b, o).id
    assert ClusterMap.from_json(smap.to_json()) == smap  # kept on disk as it is
    copies_two = _map(2).with_leaving("t1")
    assert copies_two.copies == 1 and copies_two.copies_for("three") == 1  # never more than the placed targets


def test_a_removed_target_is_remembered_and_a_dead_leaving_one_is_not():
    smap = _map(3).with_leaving("t1")
    gone = smap.retired("t1")
    assert gone.node("t1") is None and gone.leaving == () and gone.removed == ("t1",)
    assert gone.version == smap.version + 1
    dropped = smap.without("t1")  # died while leaving: dropped, not removed for good (it may come back)
    assert dropped.node("t1") is None and dropped.removed == () and dropped.leaving == ()
    old_doc = {k: v for k, v in _map(3).to_json().items() if k not in ("leaving", "removed")}
    assert ClusterMap.from_json(old_doc) == _map(3)  # a map kept by an earlier version


def test_a_maps_identity_survives_the_wire_and_tells_two_primaries_apart():
    import dataclasses

    m = _map(3).with_copies("b", 1)
    back = ClusterMap.from_json(m.to_json())  # as a target keeps the map the primary pushed
    assert back.identity == m.identity and back.identity[0] == m.version
    other = dataclasses.replace(m, primary="p-other")  # the same version made by another primary
    assert other.identity[0] == m.identity[0] and other.identity != m.identity
    # every part that places objects changes it, the version kept
    first = sorted(m.targets)[0]
    for changed in (dataclasses.replace(m, nodes=m.nodes[:-1]), dataclasses.replace(m, bucket_copies=()),
                    dataclasses.replace(m, leaving=(first,)), dataclasses.replace(m, uuid="other")):
        assert changed.identity[0] == m.version and changed.identity != m.identity


def test_maintenance_leaves_then_parks_then_comes_back():
    """``with_maintenance`` is a leaving that is kept (placement as ``with_leaving``), with
    AIStore's flags on the wire; ``with_parked`` marks it empty (not asked for copies any more);
    ``out_of_maintenance`` places on it again; a removal takes it out of every set."""
    from batchfs.wire import hrw

    full = _map(4)
    m = full.with_maintenance("t2")
    assert m.version == full.version + 1 and m.with_maintenance("t2") is m
    assert m.leaving == ("t2",) and m.maintenance == ("t2",) and set(m.placed) == {"t0", "t1", "t3"}
    objects = [(b, f"k/{i}") for i in range(200) for b in ("plain", "three", "one")]
    assert _holders(m, objects) == _holders(full.with_leaving("t2"), objects)
    assert m.wire()["tmap"]["t2"]["flags"] == hrw.SNODE_MAINT and set(hrw.smap_targets(m.wire())) == set(m.placed)
    assert all(m.sources(b, o)[-1].id == "t2" for b, o in objects)  # still asked: it holds what it held
    parked = m.with_parked("t2")
    assert parked.version == m.version + 1 and parked.parked == ("t2",) and parked.with_parked("t2") is parked
    assert parked.wire()["tmap"]["t2"]["flags"] == hrw.SNODE_MAINT | hrw.SNODE_MAINT_POST_REB
    assert all("t2" not in {n.id for n in parked.sources(b, o)} for b, o in objects)  # it holds nothing
    assert full.with_leaving("t2").with_parked("t2").parked == ()  # only a target in maintenance parks
    assert ClusterMap.from_json(parked.to_json()) == parked and parked.identity != m.identity
    back = parked.out_of_maintenance("t2")
    assert (back.leaving, back.maintenance, back.parked) == ((), (), ()) and back.version == parked.version + 1
    assert _holders(back, objects) == _holders(full, objects) and back.out_of_maintenance("t2") is back
    assert "maintenance" not in back.to_json() and back.identity[1] == full.renewed().renewed().renewed().identity[1]
    removing = parked.with_leaving("t2")  # a removal of a target in maintenance: leaving, not kept
    assert (removing.leaving, removing.maintenance, removing.parked) == (("t2",), (), ())
    for gone in (parked.retired("t2"), parked.without("t2")):
        assert (gone.leaving, gone.maintenance, gone.parked) == ((), (), ()) and gone.node("t2") is None
