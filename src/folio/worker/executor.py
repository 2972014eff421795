"""Executors: where the model runner lives. One process, or (tensor parallel)
rank 0 here and N - 1 worker processes over torch.distributed, behind the same
execute / shutdown API (worker/multiproc.py)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: FolioConfig):
        from folio.worker.model_runner import ModelRunner
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks
        self._device: Optional[ThreadPoolExecutor] = None

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def submit(self, so: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """The step run on the runner's own thread, in the order submitted (as
        a device's stream runs it), while the caller schedules the next one."""
        if self._device is None:
            self._device = ThreadPoolExecutor(1, thread_name_prefix="folio-runner")
        return self._device.submit(self.runner.execute, so)

    def shutdown(self) -> None:
        if self._device is not None:
            self._device.shutdown(wait=True)
            self._device = None


def make_executor(config: FolioConfig):
    if config.parallel.world_size == 1:
        return UniProcExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from folio.worker.ray_executor import RayExecutor
        return RayExecutor(config)
    from folio.worker.multiproc import MultiprocExecutor
    return MultiprocExecutor(config)
