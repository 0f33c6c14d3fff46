"""RayResourcePool over several nodes pins each per-node placement group to its own node (no Ray needed here;
`make test-slurm` checks the real placement on a 2-node cluster)."""

import pytest

from scaletrain.controller import resource_pool as rp


def _node(node_id, ip, cpus, gpus=0.0, alive=True):
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": res}


@pytest.fixture
def cluster(monkeypatch):
    state = {"nodes": [], "available": {}}
    monkeypatch.setattr(rp.ray, "nodes", lambda: state["nodes"])
    monkeypatch.setattr(rp.ray._private.state, "available_resources_per_node", lambda: state["available"])
    return state


def test_one_group_per_node_in_ip_order(cluster):
    cluster["nodes"] = [_node("b", "10.0.0.12", 2), _node("a", "10.0.0.11", 2)]
    assert rp._distinct_nodes([1, 1], {"CPU": 1.0}) == ["a", "b"]


def test_single_node_cluster_and_single_group_are_left_to_ray(cluster):
    cluster["nodes"] = [_node("a", "10.0.0.11", 16, gpus=8)]
    assert rp._distinct_nodes([4, 4], {"CPU": 1.0, "GPU": 1.0}) == [None, None]
    assert rp._distinct_nodes([4], {"CPU": 1.0}) == [None]


def test_nodes_without_room_or_dead_are_skipped(cluster):
    cluster["nodes"] = [
        _node("head", "10.0.0.1", 8),
        _node("dead", "10.0.0.2", 8, gpus=4, alive=False),
        _node("g1", "10.0.0.3", 8, gpus=4),
        _node("g2", "10.0.0.4", 8, gpus=4),
    ]
    assert rp._distinct_nodes([4, 4], {"CPU": 1.0, "GPU": 1.0}) == ["g1", "g2"]
    # a node with the room free right now comes before one that is full
    cluster["available"] = {"g1": {"CPU": 8.0, "GPU": 0.0}, "g2": {"CPU": 8.0, "GPU": 4.0}}
    cluster["nodes"].append(_node("g3", "10.0.0.5", 8, gpus=4))
    cluster["available"]["g3"] = {"CPU": 8.0, "GPU": 4.0}
    assert rp._distinct_nodes([4, 4], {"CPU": 1.0, "GPU": 1.0}) == ["g2", "g3"]


def test_largest_group_gets_the_node_that_fits_it(cluster):
    cluster["nodes"] = [_node("small", "10.0.0.1", 2), _node("big", "10.0.0.2", 8)]
    assert rp._distinct_nodes([1, 6], {"CPU": 1.0}) == ["small", "big"]
    cluster["nodes"] = [_node("small", "10.0.0.1", 2)] * 1 + [_node("tiny", "10.0.0.3", 1)]
    assert rp._distinct_nodes([4, 1], {"CPU": 1.0}) == [None, None]  # nothing holds 4: Ray decides (and reports)
