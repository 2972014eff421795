"""Tensor parallelism with workers placed by Ray (`--distributed-executor-backend ray`).

Ranks 1..N-1 are Ray actors, so a Ray cluster (`ray start --head` on one node,
`ray start --address=HEAD:6379` on the others) decides where they run; the
collectives are still torch.distributed (gloo on CPU, nccl on CUDA), rank 0
stays in the engine's process, and each step's SchedulerOutput reaches the
actors as a method call (Ray keeps one caller's calls to an actor in order).
"""

from __future__ import annotations

import logging
import os

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput
from folio.worker.multiproc import (_init_rank, check_tensor_parallel, describe_split,
                                    free_local_port, leave_process_group,
                                    reset_parallel_defaults, threads_per_rank)

logger = logging.getLogger("folio")


class _Worker:
    """One tensor-parallel rank inside a Ray actor."""

    def init(self, config: FolioConfig, rank: int, port: int, master: str,
             num_threads: int) -> int:
        self.runner = _init_rank(config, rank, port, num_threads, master)
        return self.runner.num_blocks

    def execute(self, so: SchedulerOutput) -> None:
        self.runner.execute(so)


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("the ray backend needs Ray: pip install -e '.[ray]' in the Folio "
                         "checkout") from e
    return ray


class RayExecutor:
    def __init__(self, config: FolioConfig):
        check_tensor_parallel(config)
        ray = self.ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        world = config.parallel.world_size
        # One node: everything on loopback; several: rank 0's address on the cluster.
        master = ("127.0.0.1" if len(ray.nodes()) == 1
                  else ray.util.get_node_ip_address())
        port = free_local_port()
        threads = threads_per_rank(config)
        # passed to each actor: its OpenMP pool starts at that size, and init sets torch's
        actor = ray.remote(num_cpus=1,
                           runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})(
            _Worker)
        self.actors = [actor.options(name=None).remote() for _ in range(1, world)]
        inits = [a.init.remote(config, rank, port, master, threads)
                 for rank, a in enumerate(self.actors, start=1)]
        try:
            self.runner = _init_rank(config, 0, port, threads, master)
            reset_parallel_defaults()
            self.num_blocks = min([self.runner.num_blocks] + ray.get(inits))
        except BaseException:
            self.shutdown()         # the actors go, and the process group with them
            raise
        logger.info("%s, workers placed by Ray", describe_split(config))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        failed = self.runner.prepare(so)    # first: the workers get the same batch
        try:
            pending = [a.execute.remote(so) for a in self.actors]
            out = self.runner.run(so)
            self.ray.get(pending)
            out.failed.update(failed)
            return out
        except Exception as e:
            raise RuntimeError(f"parallel step failed (a Ray worker died?): {e}") from e

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:        # noqa: BLE001 - best effort at exit
                pass
        self.actors = []
        leave_process_group()
