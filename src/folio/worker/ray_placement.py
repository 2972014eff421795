"""Where Ray puts the ranks (--distributed-executor-backend ray, issue 33).

One placement group, one bundle per rank: `{"CPU": threads}`, and `"GPU": 1`
on CUDA. Bundle 0 is rank 0's, the engine's own process: it is pinned to the
driver's node (the label `ray.io/node-id`) so that its GPU is reserved there.
The group is PACKed: as few nodes as hold it. Ranks then take the bundles
node by node (the driver's node first), so that the T ranks of a stage's
tensor-parallel group share a node and pipeline stages are what spans nodes
(a group that cannot stay on one node is logged: it works, over the
network). On CUDA each rank takes the GPU Ray reserved for its bundle
(`ray.get_gpu_ids()`; Ray is told not to narrow CUDA_VISIBLE_DEVICES, so the
ids are the node's own); rank 0's bundle is held by a small actor that tells
the engine's process which GPU is its own. A rank's local rank (its place
among the ranks on its node) is reported in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger("folio")

PLACEMENT_TIMEOUT_S = 60.0


def rank_bundles(world: int, cpus: int, gpu: bool) -> list[dict]:
    bundle = {"CPU": float(cpus), **({"GPU": 1.0} if gpu else {})}
    return [dict(bundle) for _ in range(world)]


@dataclass(frozen=True)
class RankPlacement:
    bundle_of_rank: list[int]       # rank -> its bundle in the placement group
    node_of_rank: list[str]
    local_rank: list[int]           # rank -> its place among the ranks on its node
    split_groups: list[int]         # stages whose tensor-parallel group spans nodes


def place_ranks(bundle_nodes: list[str], tp: int) -> RankPlacement:
    """Ranks onto bundles (bundle_nodes[i]: bundle i's node; bundle 0 is on the
    driver's node and is rank 0's): node by node, the driver's first, then
    in the order the nodes first hold a bundle."""
    driver = bundle_nodes[0]
    nodes = [driver] + [n for i, n in enumerate(bundle_nodes)
                        if n != driver and n not in bundle_nodes[:i]]
    order = [0] + [b for node in nodes for b, n in enumerate(bundle_nodes)
                   if n == node and b != 0]
    node_of_rank = [bundle_nodes[b] for b in order]
    seen: dict[str, int] = {}
    local = []
    for node in node_of_rank:
        local.append(seen.get(node, 0))
        seen[node] = local[-1] + 1
    split = [s for s in range(len(order) // tp)
             if len(set(node_of_rank[s * tp:(s + 1) * tp])) > 1]
    return RankPlacement(order, node_of_rank, local, split)


def device_index(gpu_id: int, visible: Optional[str]) -> int:
    """The CUDA device index of the node's GPU `gpu_id` in a process whose
    CUDA_VISIBLE_DEVICES is `visible` (None: every GPU, in the node's order)."""
    if not visible:
        return gpu_id
    ids = [v.strip() for v in visible.split(",")]
    if str(gpu_id) not in ids:
        raise ValueError(f"GPU {gpu_id}, which Ray reserved for this rank, is not in "
                         f"CUDA_VISIBLE_DEVICES={visible}")
    return ids.index(str(gpu_id))


class GpuHolder:
    """An actor in a bundle, holding its GPU: which one Ray gave it."""

    def gpu(self) -> int:
        import ray
        return int(ray.get_gpu_ids()[0])


def make_placement_group(ray, world: int, cpus: int, gpu: bool):
    """The group, ready, and its RankPlacement for `tp`-rank groups; a clear
    error when the cluster cannot hold it."""
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import (placement_group, placement_group_table,
                                          remove_placement_group)
    driver = ray.get_runtime_context().get_node_id()
    bundles = rank_bundles(world, cpus, gpu)
    pg = placement_group(bundles, strategy="PACK",
                         bundle_label_selector=[{"ray.io/node-id": driver}] + [{}] * (world - 1))
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:     # the cluster lacks the resources
        remove_placement_group(pg)
        raise ValueError(
            f"Ray could not place {world} ranks of {bundles[0]} each (the first on this "
            f"node) within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
            f"{ray.cluster_resources()}") from None
    except BaseException:
        remove_placement_group(pg)
        raise
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return pg, [nodes[i] for i in range(world)]


def log_placement(placement: RankPlacement, tp: int) -> None:
    nodes = list(dict.fromkeys(placement.node_of_rank))
    logger.info("Ray placement: ranks on %d node(s): %s", len(nodes), "; ".join(
        f"{n[:8]}: ranks {[r for r, m in enumerate(placement.node_of_rank) if m == n]}"
        for n in nodes))
    for s in placement.split_groups:
        logger.warning("the tensor-parallel group of stage %d (ranks %d-%d) spans nodes: its "
                       "all-reduces cross the network (give nodes a multiple of "
                       "--tensor-parallel-size GPUs)", s, s * tp, (s + 1) * tp - 1)
