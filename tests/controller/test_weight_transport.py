"""Split placement's collective push by its two lanes (scaletrain/controller/weight_transport.py, push_lanes.py),
between real processes over a real gloo group: a receiver on the sender's node views the sender's shared-memory
slots, a receiver of another node (its node key made to differ: a second node cannot exist here) is sent the bytes;
a slow receiver never sees a slot rewritten under it; a bucket /dev/shm cannot hold goes over the group instead.
The end-to-end push into vLLM engines is tests/workers/test_weight_push.py."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from backends.rollout.ipc_transport import PREFIX, shm_dir
from scaletrain.controller.push_lanes import RING, SlotViews
from scaletrain.controller.weight_transport import ARENAS, SMALL, WeightChannel
from tests.controller.workers import PushMember


def make_buckets(seed: int, count: int = 8, large: int = 300_000) -> list[list[tuple[str, torch.Tensor]]]:
    """``count`` buckets, each a float32 tensor of ``large`` elements (1.2 MB: sent on its own) and a run of small
    ones of other dtypes (packed together)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (f"layers.{b}.weight", torch.randn(large, generator=g)),
            (f"layers.{b}.norm", torch.randn(64, generator=g).to(torch.bfloat16)),
            (f"layers.{b}.ids", torch.randint(0, 9, (3, 5), generator=g)),
        ]
        for b in range(count)
    ]


def assert_received(got: list, buckets: list) -> None:
    want = [entry for bucket in buckets for entry in bucket]
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, tensor), (_, expected) in zip(got, want):
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), name


@pytest.fixture(scope="module")
def members(ray_cluster):
    """The sender, a receiver on its node, a receiver of 'another node'."""
    member = ray_cluster.remote(num_cpus=0)(PushMember)
    group = [member.remote(0), member.remote(1), member.remote(2, other_node=True)]
    yield group
    for actor in group:
        ray_cluster.kill(actor)


def open_channel(ray, members, same_node: str = "shm") -> WeightChannel:
    host, port = ray.get(members[0].open.remote())
    return WeightChannel(host, port, len(members), timeout_s=60.0, same_node=same_node)


def push(ray, members, channel, buckets, load_s: float = 0.0, file_size_limit: int | None = None):
    """(what the sender returned, each receiver's (tensors, read the slots, receive buffers))."""
    sent = members[0].send.remote(channel, buckets, file_size_limit)
    received = ray.get([m.receive.remote(channel, load_s) for m in members[1:]])
    return ray.get(sent), received


@pytest.mark.parametrize("same_node", ["shm", "broadcast"])
def test_an_export_failing_mid_push_fails_every_receiver_and_a_failing_load_leaves_no_one_waiting(
    ray_cluster, members, same_node
):
    """The sender's export raises at bucket 5: both receivers raise at once (an abort arrives, no timeout).
    Then, on the same group, the node's receiver fails loading bucket 2: it reads the push to its end first, so
    the sender and the other receiver finish, and the next push is whole on both."""
    channel = open_channel(ray_cluster, members, same_node)
    buckets = make_buckets(6)
    sent = members[0].send.remote(channel, buckets, None, 5)
    for call in [receiver.receive.remote(channel) for receiver in members[1:]]:
        with pytest.raises(ray_cluster.exceptions.RayTaskError, match="the trainer's export failed mid-push"):
            ray_cluster.get(call, timeout=50)
    with pytest.raises(ray_cluster.exceptions.RayTaskError, match="export failed at bucket 5"):
        ray_cluster.get(sent, timeout=50)

    channel = open_channel(ray_cluster, members, same_node)
    sent = members[0].send.remote(channel, buckets)
    failing = members[1].receive.remote(channel, 0.0, 2)
    whole, _, _ = ray_cluster.get(members[2].receive.remote(channel), timeout=50)
    assert_received(whole, buckets)
    with pytest.raises(ray_cluster.exceptions.RayTaskError, match="the engine cannot load bucket 2"):
        ray_cluster.get(failing, timeout=50)
    ray_cluster.get(sent, timeout=50)
    (_, _), received = push(ray_cluster, members, channel, buckets)
    for got, _, _ in received:
        assert_received(got, buckets)


def test_the_senders_node_views_its_slots_and_another_node_is_sent_the_bytes(ray_cluster, members):
    channel = open_channel(ray_cluster, members)
    sender = ray_cluster.get(members[0].pid.remote())
    slot_files = os.path.join(shm_dir(), f"{PREFIX}{sender}-*")
    before = set(glob.glob(slot_files))  # other channels' rings (earlier tests)
    for seed in (1, 2):  # the second push reuses the first's slots and buffers
        buckets = make_buckets(seed)
        # a slow engine on both receivers: the sender may run ahead only as far as the slots allow
        (sent, ran_out), [(local, on_node, local_buffers), (remote, off_node, remote_buffers)] = push(
            ray_cluster, members, channel, buckets, load_s=0.05
        )
        assert sent == sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        assert not ran_out
        assert_received(local, buckets)
        assert_received(remote, buckets)
        assert (on_node, local_buffers) == (True, 0)  # it viewed the slots: no bytes came to it
        assert (off_node, remote_buffers) == (False, ARENAS)
    assert len(set(glob.glob(slot_files)) - before) == RING  # kept for the next push, not made for each


def test_the_broadcast_lane_sends_every_rank_the_bytes(ray_cluster, members):
    channel = open_channel(ray_cluster, members, same_node="broadcast")
    buckets = make_buckets(3, count=4)
    (_, ran_out), received = push(ray_cluster, members, channel, buckets)
    for got, on_node, buffers in received:
        assert_received(got, buckets)
        assert (on_node, buffers) == (False, ARENAS)
    assert not ran_out


def test_a_bucket_dev_shm_cannot_hold_goes_over_the_group(ray_cluster, members):
    """The sender may not grow a file past 1 MiB (as a nearly full /dev/shm): the buckets with a 1.2 MB tensor
    go to every rank over the group, the small ones still through the slots, in one push."""
    channel = open_channel(ray_cluster, members)
    buckets = [bucket for pair in zip(make_buckets(4, 3), make_buckets(5, 3, large=1000)) for bucket in pair]
    assert sum(t.numel() * t.element_size() for _, t in buckets[0]) > SMALL
    (_, ran_out), received = push(ray_cluster, members, channel, buckets, load_s=0.02, file_size_limit=SMALL)
    assert ran_out
    for got, _, _ in received:
        assert_received(got, buckets)
    assert received[0][1:] == (True, ARENAS)  # the node's receiver took the large buckets into buffers of its own


def test_a_slot_named_over_the_network_must_be_a_senders_slot(tmp_path):
    """The slot's path arrives over the push group, whose store listens on the network: it names no other file."""
    meta, offsets, sizes = [("w", torch.float32, (4,))], [0], [16]
    other = tmp_path / "secret"
    other.write_bytes(b"x" * 64)
    for path, size in ((str(other), 64), (os.path.join(shm_dir(), "passwd"), 64), (f"{shm_dir()}/{PREFIX}1-a", 8)):
        with pytest.raises(RuntimeError, match="is not a sender's slot"):
            SlotViews().bucket([0, path, size], meta, offsets, sizes, 16)
