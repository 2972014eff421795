"""Tensor and pipeline parallelism with workers placed by Ray
(`--distributed-executor-backend ray`).

Ranks 1..N-1 are Ray actors, each in its bundle of one placement group
(worker/ray_placement.py: one bundle per rank, a tensor-parallel group on
one node, pipeline stages across nodes, each rank on its bundle's GPU), so a
Ray cluster (`ray start --head` on one node, `ray start --address=HEAD:6379`
on the others) decides where they run; the collectives are still
torch.distributed (gloo on CPU, nccl on CUDA), rank 0 stays in the engine's
process, and each step's SchedulerOutput reaches the actors as a method call
(Ray keeps one caller's calls to an actor in order). A rank lost with its
node fails the step: rank 0's collective or receive breaks (a closed peer,
or the collective timeout), or Ray reports the actor dead.
"""

from __future__ import annotations

import logging
import os

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput
from folio.worker.runner_facts import RunnerFacts
from folio.worker.multiproc import (_init_rank, check_tensor_parallel, describe_split,
                                    free_local_port, leave_process_group,
                                    reset_parallel_defaults, threads_per_rank)
from folio.worker.ray_placement import (GpuHolder, device_index, log_placement,
                                        make_placement_group, place_ranks)

logger = logging.getLogger("folio")


class _Worker:
    """One rank inside a Ray actor."""

    def init(self, config: FolioConfig, rank: int, port: int, master: str,
             num_threads: int) -> int:
        device = None
        if config.device.startswith("cuda"):        # the GPU Ray reserved for this bundle
            import ray
            device = device_index(int(ray.get_gpu_ids()[0]),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.runner = _init_rank(config, rank, port, num_threads, master, device)
        return self.runner.num_blocks

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def execute(self, so: SchedulerOutput) -> None:
        self.runner.execute(so)


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("the ray backend needs Ray: pip install -e '.[ray]' in the Folio "
                         "checkout") from e
    return ray


class RayExecutor(RunnerFacts):
    def __init__(self, config: FolioConfig):
        check_tensor_parallel(config)
        ray = self.ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        self.actors, self.workers, self.pg = [], [], None
        try:
            self._start(ray, config)
        except BaseException:
            self.shutdown()     # the group, the actors and the process group go with it
            raise
        logger.info("%s, workers placed by Ray", describe_split(config))

    def _start(self, ray, config: FolioConfig) -> None:
        world, tp = config.parallel.world_size, config.parallel.tensor_parallel_size
        cuda = config.device.startswith("cuda")
        threads = threads_per_rank(config)
        self.pg, bundle_nodes = make_placement_group(ray, world, threads, cuda)
        self.placement = place_ranks(bundle_nodes, tp)
        log_placement(self.placement, tp)
        # One node: everything on loopback; several: rank 0's address on the cluster.
        master = ("127.0.0.1" if len(set(bundle_nodes)) == 1
                  else ray.util.get_node_ip_address())
        port = free_local_port()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def in_bundle(cls, bundle: int, **options):
            return ray.remote(cls).options(
                num_gpus=1 if cuda else 0, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundle), **options).remote()
        # each actor's OpenMP pool starts at its share; on CUDA every rank sees
        # its node's GPUs and takes the one Ray reserved for its bundle
        env = {"OMP_NUM_THREADS": str(threads)}
        if cuda:
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        device = None
        if cuda:        # rank 0's bundle: held by an actor that says which GPU it is
            self.actors.append(in_bundle(GpuHolder, 0, num_cpus=0))
            device = device_index(ray.get(self.actors[0].gpu.remote()),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        workers = [in_bundle(_Worker, self.placement.bundle_of_rank[rank], num_cpus=threads)
                   for rank in range(1, world)]
        self.actors.extend(workers)
        self.workers = workers
        inits = [a.init.remote(config, rank, port, master, threads)
                 for rank, a in enumerate(workers, start=1)]
        self.runner = _init_rank(config, 0, port, threads, master, device)
        reset_parallel_defaults()
        self.num_blocks = min([self.runner.num_blocks] + ray.get(inits))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        failed = self.runner.prepare(so)    # first: the workers get the same batch
        try:
            pending = [a.execute.remote(so) for a in self.workers]
            out = self.runner.run(so)
            self.ray.get(pending)
            out.failed.update(failed)
            return out
        except Exception as e:
            raise RuntimeError(f"parallel step failed (a Ray worker died, or its node?): "
                               f"{e}") from e

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:        # noqa: BLE001 - best effort at exit
                pass
        self.actors = []
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            except Exception:        # noqa: BLE001 - best effort at exit
                pass
            self.pg = None
        leave_process_group()
