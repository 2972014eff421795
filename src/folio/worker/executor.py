"""Executors: where the model runner lives. One process for now; tensor
parallelism will add N workers over torch.distributed behind the same API."""

from __future__ import annotations

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: FolioConfig):
        from folio.worker.model_runner import ModelRunner
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def shutdown(self) -> None:
        pass


def make_executor(config: FolioConfig) -> UniProcExecutor:
    if config.parallel.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size > 1 is not supported yet")
    return UniProcExecutor(config)
