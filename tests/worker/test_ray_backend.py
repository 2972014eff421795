"""The Ray executor backend on a local Ray instance (2 CPUs, no dashboard, usage
stats off, loopback only): tp=2 on a tiny model gives one rank's tokens, after
a failed start on a truncated checkpoint that leaves nothing behind. Placement
(worker/ray_placement.py): ranks onto bundles node by node with their local
ranks; on a two-node Ray cluster on this machine (two raylets, declared GPUs
standing in for real ones) a GPU placement group keeps each tensor-parallel
group on a node, P=2 x T=2 runs there with stage 1 on the other node and
gives one rank's tokens, and that node's loss fails the step, not a hang."""

import shutil
import sys

import pytest

from folio import LLM, SamplingParams
from tests.utils import make_tiny_model
from tests.worker.ranks import fails_mid_run


def test_asking_for_ray_without_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)          # as if not installed
    path = make_tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match=r"pip install -e .\.\[ray\]. in the Folio checkout"):
        LLM(path, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2,
            distributed_executor_backend="ray")


def test_ray_tp2_matches_one_rank(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    path = make_tiny_model(tmp_path / "m")
    prompts = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts, params)]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        # a failed start first: the actors and the process group must go with it
        bad = tmp_path / "truncated"
        shutil.copytree(path, bad)
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            LLM(str(bad), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                distributed_executor_backend="ray")
        from ray.util import placement_group_table
        assert {g["state"] for g in placement_group_table().values()} <= {"REMOVED"}
        llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
    assert got == expected


def test_ranks_take_bundles_node_by_node_with_local_ranks():
    from folio.worker.ray_placement import place_ranks, rank_bundles
    assert rank_bundles(3, 2, gpu=True) == [{"CPU": 2.0, "GPU": 1.0}] * 3
    assert rank_bundles(2, 1, gpu=False) == [{"CPU": 1.0}] * 2
    p = place_ranks(["A", "B", "A", "B"], tp=2)     # Ray spread the bundles alternately
    assert p.bundle_of_rank == [0, 2, 1, 3]
    assert p.node_of_rank == ["A", "A", "B", "B"] and p.local_rank == [0, 1, 0, 1]
    assert p.split_groups == []
    p = place_ranks(["A", "C", "C", "B", "B", "C"], tp=2)     # 3 stages
    assert p.node_of_rank == ["A", "C", "C", "C", "B", "B"]
    assert p.local_rank == [0, 0, 1, 2, 0, 1]
    assert p.split_groups == [0]       # rank 0 alone on the driver node: stage 0 spans A, C
    p = place_ranks(["A", "A", "A", "B"], tp=2)
    assert p.split_groups == [1] and p.local_rank == [0, 1, 2, 0]


@pytest.fixture
def two_nodes(monkeypatch):
    """A Ray cluster of two nodes on this machine (two raylets), each with 2
    CPUs and 2 declared GPUs (none real: they stand in for a node's GPUs)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    second = cluster.add_node(num_cpus=2, num_gpus=2)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        cluster.wait_for_nodes()
        yield ray, cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_gpu_placement_keeps_each_tensor_parallel_group_on_a_node(two_nodes, monkeypatch):
    ray, _, _ = two_nodes
    from ray.util.placement_group import remove_placement_group

    from folio.worker import ray_placement
    from folio.worker.ray_placement import make_placement_group, place_ranks
    monkeypatch.setattr(ray_placement, "PLACEMENT_TIMEOUT_S", 3.0)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from folio.worker.ray_placement import GpuHolder, device_index
    driver = ray.get_runtime_context().get_node_id()
    pg, nodes = make_placement_group(ray, 4, 1, gpu=True)
    try:
        assert nodes[0] == driver and len(set(nodes)) == 2
        p = place_ranks(nodes, tp=2)
        assert p.node_of_rank[:2] == [driver] * 2 and p.node_of_rank[2] == p.node_of_rank[3]
        assert p.local_rank == [0, 1, 0, 1] and p.split_groups == []
        # each rank's GPU is the one Ray reserved for its bundle: on a node, all differ
        holders = [ray.remote(GpuHolder).options(
            num_cpus=0, num_gpus=1, runtime_env={"env_vars": {
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=b)).remote() for b in p.bundle_of_rank]
        gpus = ray.get([h.gpu.remote() for h in holders])
        assert sorted(gpus[:2]) == [0, 1] and sorted(gpus[2:]) == [0, 1]
        for h in holders:
            ray.kill(h)
    finally:
        remove_placement_group(pg)
    assert device_index(3, None) == 3 and device_index(3, "2,3") == 1
    with pytest.raises(ValueError, match="GPU 3, which Ray reserved"):
        device_index(3, "0,1")
    with pytest.raises(ValueError, match=r"Ray could not place 5 ranks of \{'CPU': 1.0, "
                                         r"'GPU': 1.0\}"):
        make_placement_group(ray, 5, 1, gpu=True)


def test_two_stages_on_two_nodes_and_a_lost_node_fails_the_step(two_nodes, tmp_path):
    ray, cluster, second = two_nodes
    path = make_tiny_model(tmp_path / "m", num_hidden_layers=4)
    prompts = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50 + i] * 2} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts, params)]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
              pipeline_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.engine.executor
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected
        # stage 0 (ranks 0, 1) on the driver's node, stage 1 (ranks 2, 3) on the other
        driver = ray.get_runtime_context().get_node_id()
        actual = [driver] + ray.get([a.node.remote() for a in executor.workers])
        assert actual == executor.placement.node_of_rank
        assert actual[:2] == [driver] * 2 and actual[2] == actual[3] != driver
        # the second node goes away mid-run: the step fails, no hang
        fails_mid_run(llm, lambda: cluster.remove_node(second, allow_graceful=False),
                      within=90)
    finally:
        llm.shutdown()
