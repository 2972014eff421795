"""Tensor and pipeline parallelism over torch.distributed: rank 0 in the
engine's process, ranks 1..N-1 in worker processes started with `spawn`
(N = tensor_parallel_size x pipeline_parallel_size; rank r is stage r // T,
tensor-parallel rank r % T).

Every step rank 0 sends the SchedulerOutput down a pipe to each worker; all
ranks then run the same step (each on its shard of every layer of its stage,
joined by all-reduces within the stage and an all-gather of the logits on
stage 0; the stages pass activations on, worker/pipeline_stage.py) and only
rank 0's sampled tokens are used. A worker that dies makes rank 0's next collective fail, so the
engine reports an error instead of hanging; a worker whose pipe closes (the
engine is gone) exits.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.machinery
import logging
import multiprocessing as mp
import socket
import sys
from typing import TYPE_CHECKING, Optional

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput
from folio.worker.runner_facts import RunnerFacts

if TYPE_CHECKING:
    from folio.worker.model_runner import ModelRunner

logger = logging.getLogger("folio")
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def check_tensor_parallel(config: FolioConfig) -> None:
    """A clear error at start when the model cannot be split N ways."""
    tp, m = config.parallel.tensor_parallel_size, config.model
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if m.num_attention_heads % tp:
        raise ValueError(f"the model's {m.num_attention_heads} attention heads cannot be split "
                         f"across tensor_parallel_size={tp} ranks")
    kv = m.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"the model's {kv} KV heads can neither be split across nor "
                         f"replicated over tensor_parallel_size={tp} ranks")
    if m.intermediate_size % tp:
        raise ValueError(f"the model's intermediate size {m.intermediate_size} is not divisible "
                         f"by tensor_parallel_size={tp}")


def describe_split(config: FolioConfig) -> str:
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    if pp == 1:
        return f"tensor parallel: {tp} ranks"
    return f"pipeline parallel: {pp} stages of {tp} tensor-parallel rank(s)"


@contextlib.contextmanager
def _main_not_rerun():
    """Start spawned workers without running the user's script again.

    A spawned child re-imports the parent's __main__ (as __mp_main__), so that
    objects defined there can be unpickled. A script that calls LLM(...) at
    module level, without an `if __name__ == "__main__":` guard (most quick
    scripts), would build the engine again in every worker; that engine tries
    to start workers of its own, fails, and the parent waits for ranks that
    never join. Nothing a worker receives lives in __main__, so while a worker
    starts, __main__ is described as a package's __main__ module, which
    multiprocessing never re-runs.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = getattr(main, "__spec__", None)
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = saved


def free_local_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(config: FolioConfig) -> int:
    """Each rank's share of the engine's threads (ranks on one machine)."""
    from folio.worker.cpu_threads import default_threads
    return max(1, default_threads()[0] // config.parallel.world_size)


def join_groups(config: FolioConfig, rank: int) -> None:
    """This rank's tensor-parallel rank, pipeline stage and the stage's group.
    Every rank makes every stage's group, in the same order (new_group is
    collective); with one stage the world is the group."""
    import torch.distributed as dist

    from folio.distributed.parallel_state import (set_pipeline_back_group,
                                                  set_pipeline_parallel, set_tensor_parallel,
                                                  set_tensor_parallel_group)
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    group = back = None
    if pp > 1:
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        group = groups[rank // tp]
        # stage 0's rank t and the last stage's rank t: the results' way back
        backs = [dist.new_group([t, (pp - 1) * tp + t]) for t in range(tp)]
        back = backs[rank % tp] if rank // tp in (0, pp - 1) else None
    set_tensor_parallel_group(group)
    set_pipeline_back_group(back)
    set_tensor_parallel(rank % tp, tp)
    set_pipeline_parallel(rank // tp, pp)


def reset_parallel_defaults() -> None:
    """The process-wide split back to one rank: the layers keep the one they
    were built with, and another model built in this process is whole."""
    from folio.distributed.parallel_state import set_pipeline_parallel, set_tensor_parallel
    set_tensor_parallel(0, 1)
    set_pipeline_parallel(0, 1)


def leave_process_group() -> None:
    """This process's end of the tensor-parallel group, if it is in one (best
    effort: at exit, or after a failed start)."""
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:           # noqa: BLE001 - nothing left to tell
        pass


def _init_rank(config: FolioConfig, rank: int, port: int, num_threads: int,
               master: str = "127.0.0.1", device: Optional[int] = None) -> "ModelRunner":
    """`device`: the CUDA device index this rank runs on (default: the rank,
    every rank on one machine)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank if device is None else device)
    dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=config.parallel.world_size, timeout=COLLECTIVE_TIMEOUT)
    from folio.worker.model_runner import ModelRunner
    try:
        join_groups(config, rank)
        return ModelRunner(config, num_threads=num_threads, is_driver=rank == 0)
    except BaseException:
        # a malformed checkpoint, too little memory...: leave this process as
        # it was, so that the caller can fix it and build an engine again
        reset_parallel_defaults()
        leave_process_group()
        raise


def _worker_main(config: FolioConfig, rank: int, port: int, conn, num_threads: int) -> None:
    try:
        runner = _init_rank(config, rank, port, num_threads)
    except Exception as e:              # noqa: BLE001 - told to rank 0, which raises it
        from folio.errors import is_expected_error
        conn.send(("failed", f"{type(e).__name__}: {e}", is_expected_error(e)))
        return
    conn.send(runner.num_blocks)
    while True:
        try:
            so = conn.recv()
        except (EOFError, OSError):       # the engine is gone
            break
        if so is None:
            break
        runner.execute(so)
    leave_process_group()


class MultiprocExecutor(RunnerFacts):
    def __init__(self, config: FolioConfig):
        check_tensor_parallel(config)
        world = config.parallel.world_size
        port = free_local_port()
        ctx = mp.get_context("spawn")
        self.workers, self.pipes = [], []
        threads = threads_per_rank(config)       # passed to each worker, which sets its own
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, port, child, threads),
                               daemon=True, name=f"folio-rank{rank}")
            with _main_not_rerun():
                proc.start()
            child.close()
            self.workers.append(proc)
            self.pipes.append(parent)
        try:
            self.runner = _init_rank(config, 0, port, threads)
            reset_parallel_defaults()
            counts = {self.runner.num_blocks} | {self._started(r, p)
                                                 for r, p in enumerate(self.pipes, start=1)}
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self.num_blocks = min(counts)
        logger.info("%s over %s", describe_split(config),
                    "nccl" if config.device.startswith("cuda") else "gloo")

    @staticmethod
    def _started(rank: int, pipe) -> int:
        """The worker's KV block count once its model is built, or its error."""
        try:
            reply = pipe.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"parallel rank {rank} exited while starting") from None
        if isinstance(reply, tuple):
            _, message, expected = reply
            # the user's to fix (a bad checkpoint, a bad value): one line, as on rank 0
            kind = ValueError if expected else RuntimeError
            raise kind(f"parallel rank {rank} failed to start: {message}")
        return reply

    def check_workers(self) -> None:
        dead = [p.name for p in self.workers if not p.is_alive()]
        if dead:
            raise RuntimeError(f"parallel worker(s) {', '.join(dead)} died")

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.check_workers()
        failed = self.runner.prepare(so)    # first: the workers get the same batch
        try:
            for pipe in self.pipes:
                pipe.send(so)
            out = self.runner.run(so)
            out.failed.update(failed)
            return out
        except Exception as e:
            self.check_workers()
            raise RuntimeError(f"parallel step failed: {e}") from e

    def shutdown(self, graceful: bool = True) -> None:
        """The workers asked to stop (killed if they do not within 10 s), then the
        process group left. `graceful=False`, after a failed start: the workers
        are killed at once, not asked (one may be waiting for a rendezvous that
        will not come)."""
        for pipe in self.pipes if graceful else ():
            try:
                pipe.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self.workers:
            if graceful:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        leave_process_group()
