"""RayResourcePool: the processes a worker group may use, as one Ray placement group per node (layer 3).

``RayResourcePool(process_on_nodes=[4, 4], use_gpu=True)`` reserves 4 bundles on each of two nodes (each bundle
one GPU when ``use_gpu`` plus ``cpus_per_worker`` CPUs). Several worker groups may share a pool: each worker then
takes ``1 / max_colocate_count`` of its bundle. Placement groups are ordered by node IP so global ranks are
contiguous per node and stable across runs.
"""

from __future__ import annotations

import ipaddress
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

logger = logging.getLogger(__name__)


@dataclass
class RayResourcePool:
    process_on_nodes: list[int] = field(default_factory=lambda: [1])
    use_gpu: bool = True
    max_colocate_count: int = 1
    name_prefix: str = ""
    cpus_per_worker: float = 1.0
    ready_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.process_on_nodes or any(int(n) <= 0 for n in self.process_on_nodes):
            raise ValueError(f"process_on_nodes must list positive process counts, got {self.process_on_nodes}")
        if self.max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {self.max_colocate_count}")
        self._pgs: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        res = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            res["GPU"] = 1.0
        return res

    def actor_resources(self) -> dict[str, float]:
        """What one worker of one of ``max_colocate_count`` colocated groups asks of its bundle."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.cpus_per_worker * share, "num_gpus": share if self.use_gpu else 0}

    def get_placement_groups(self) -> list[PlacementGroup]:
        if self._pgs is None:
            tag = f"{self.name_prefix or 'pool'}_{uuid.uuid4().hex[:8]}"
            targets = _distinct_nodes(self.process_on_nodes, self.bundle)
            pgs = [
                placement_group(
                    [self.bundle] * n,
                    strategy="STRICT_PACK",
                    name=f"{tag}_node{i}",
                    # Ray annotates this None-default parameter as a plain list
                    bundle_label_selector=_node_selector(node, n),  # pyright: ignore[reportArgumentType]
                )
                for i, (n, node) in enumerate(zip(self.process_on_nodes, targets))
            ]
            ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
            if len(ready) < len(pgs):
                for pg in pgs:
                    remove_placement_group(pg)
                raise RuntimeError(
                    f"resource pool {self.process_on_nodes} x {self.bundle} could not be placed within "
                    f"{self.ready_timeout_s:.0f}s; the cluster has {ray.cluster_resources()} "
                    f"(available {ray.available_resources()})"
                )
            self._pgs = _sort_by_node_ip(pgs)
            logger.debug("placed resource pool %s x %s", self.process_on_nodes, self.bundle)
        return self._pgs

    def local_sizes(self) -> list[int]:
        """Processes per placement group, in the sorted placement-group order."""
        return [len(pg.bundle_specs) for pg in self.get_placement_groups()]

    def release(self) -> None:
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None


def _node_selector(node: str | None, bundles: int) -> list[dict[str, str]] | None:
    """The bundle_label_selector that pins a placement group's ``bundles`` bundles to ``node`` (None: anywhere)."""
    return None if node is None else [{"ray.io/node-id": node}] * bundles


def _distinct_nodes(process_on_nodes: list[int], bundle: dict[str, float]) -> list[str | None]:
    """One distinct node ID per placement group, or all None (Ray places them) on a cluster with too few nodes.

    ``process_on_nodes`` means one entry per node, but STRICT_PACK groups are independent: Ray may pack two of them
    onto one node with room for both. On a cluster with enough alive nodes that can each hold a group (by total
    resources), each group is pinned to its own node (largest groups first, nodes in IP order). With fewer such
    nodes, e.g. a single-node cluster declaring fake GPUs for a [4, 4] pool, Ray places the groups as before.
    """
    if len(process_on_nodes) < 2:
        return [None] * len(process_on_nodes)
    try:  # prefer nodes with room now over nodes that are full (e.g. held by another pool)
        # a private Ray API (pyright: not exported)
        state = ray._private.state  # pyright: ignore[reportPrivateImportUsage, reportAttributeAccessIssue]
        available = state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - a private API: without it, IP order alone
        available = {}
    free = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: _ip_key(n.get("NodeManagerAddress", "")))
    targets: list[str | None] = [None] * len(process_on_nodes)
    for i in sorted(range(len(process_on_nodes)), key=lambda i: -process_on_nodes[i]):
        need = {k: v * process_on_nodes[i] for k, v in bundle.items()}
        fits = [n for n in free if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
        room = [n for n in fits if all(available.get(n["NodeID"], {}).get(k, 0.0) >= v for k, v in need.items())]
        node = (room or fits or [None])[0]
        if node is None:
            return [None] * len(process_on_nodes)
        free.remove(node)
        targets[i] = node["NodeID"]
    return targets


def _ip_key(ip: str) -> Any:
    try:
        return ipaddress.ip_address(ip)
    except ValueError:
        return ipaddress.ip_address("0.0.0.0")


def _sort_by_node_ip(pgs: list[PlacementGroup]) -> list[PlacementGroup]:
    ip_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}

    def key(item: tuple[int, Any]) -> tuple[Any, int]:
        i, pg = item
        node_ids = placement_group_table(pg).get("bundles_to_node_id", {})
        ip = ip_of.get(node_ids.get(0) if isinstance(node_ids, dict) else None, "")
        return (_ip_key(ip), i)

    return [pg for _, pg in sorted(enumerate(pgs), key=key)]
