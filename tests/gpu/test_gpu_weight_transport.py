"""The weight transports' CUDA paths (``make test-gpu``; each test skips, saying why, without CUDA):

- ``checkpoint_engine.backend=cuda_ipc``: buckets reach another process through two device buffers opened by CUDA
  IPC handles (backends/rollout/ipc_transport.py), arriving equal, with nothing written to /dev/shm;
- ``nccl`` between pools: the push group on NCCL (scaletrain/controller/weight_transport.py), where 2 GPUs exist.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import Future

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (make test-gpu on a GPU machine)")]


def buckets(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1024, 512), (512,), (3, 7), (4096, 256), (1,)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32]
    items = [(f"t{i}", torch.randn(s, generator=g).to(d)) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    return [items[:2], items[2:4], items[4:]]


def _receive(address: str, out: str) -> None:
    from backends.rollout.ipc_transport import receive_buckets

    torch.cuda.set_device(0)
    got = {name: t.float().cpu() for bucket in receive_buckets(address) for name, t in bucket}
    torch.save(got, out)


def test_cuda_ipc_slots_carry_every_bucket_to_another_process(tmp_path):
    from backends.rollout.ipc_transport import SlotSender

    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    sender = SlotSender("cuda")
    context = multiprocessing.get_context("spawn")
    for sync, seed in enumerate((1, 2)):  # the slots are reused by the second sync
        out = str(tmp_path / f"got{sync}.pt")

        def start(address: str) -> Future:
            process = context.Process(target=_receive, args=(address, out))
            process.start()
            done: Future = Future()

            def wait() -> None:
                process.join()
                if process.exitcode == 0:
                    done.set_result(None)
                else:
                    done.set_exception(RuntimeError(f"receiver exited {process.exitcode}"))

            threading.Thread(target=wait, daemon=True).start()
            return done

        sent = [[(n, t.cuda()) for n, t in b] for b in buckets(seed)]
        _, nbytes = sender.send(sent, start)
        got = torch.load(out)
        for name, tensor in (item for b in buckets(seed) for item in b):
            assert torch.equal(got[name], tensor.float()), name
        assert nbytes == sum(t.numel() * t.element_size() for b in sent for _, t in b)
    sender.close()
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {n for n in after - before if n.startswith("scaletrain-sync-")}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL push needs 2 GPUs (one per rank)")
def test_the_nccl_push_group_carries_every_bucket():
    import ray

    from scaletrain.controller.weight_transport import WeightChannel

    ray.init(address="local", num_gpus=2, include_dashboard=False, logging_level="ERROR")
    try:

        @ray.remote(num_gpus=1)
        class Member:
            def open(self) -> tuple[str, int]:
                from scaletrain.controller.weight_transport import open_store

                host = ray.util.get_node_ip_address()
                return host, open_store(host, 120.0)

            def send(self, channel) -> int:
                from scaletrain.controller.weight_transport import send_buckets

                return send_buckets(channel, iter([[(n, t.cuda()) for n, t in b] for b in buckets(3)]), None)

            def receive(self, channel) -> dict:
                from scaletrain.controller.weight_transport import ReceivedPush, drain

                push = ReceivedPush(channel, 0)
                got = {n: t.float().cpu() for b in push.buckets for n, t in b}
                drain(push.buckets)
                return got

        sender, receiver = Member.remote(), Member.remote()
        host, port = ray.get(sender.open.remote())
        channel = WeightChannel(host, port, 2, device="cuda", timeout_s=120.0)
        sent, got = ray.get([sender.send.remote(channel), receiver.receive.remote(channel)])
        for name, tensor in (item for b in buckets(3) for item in b):
            assert torch.equal(got[name], tensor.float()), name
        assert sent == sum(t.numel() * t.element_size() for b in buckets(3) for _, t in b)
    finally:
        ray.shutdown()
