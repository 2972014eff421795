"""Executors: where the model runner lives. One process, or (tensor parallel)
rank 0 here and N - 1 worker processes over torch.distributed, behind the same
execute / shutdown API (worker/multiproc.py)."""

from __future__ import annotations

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput
from folio.worker.runner_facts import RunnerFacts


class StepHandle:
    """A step handed to the device: its output once the device is done with it
    (`result` waits on the runner's event for the step; no wait where the
    runner's work is the host's own, on the CPU)."""

    __slots__ = ("_out", "_event")

    def __init__(self, out: ModelRunnerOutput, event):
        self._out, self._event = out, event

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._out.materialize()


class UniProcExecutor(RunnerFacts):
    def __init__(self, config: FolioConfig):
        from folio.worker.model_runner import ModelRunner
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(so).result()

    def submit(self, so: SchedulerOutput) -> StepHandle:
        """The step handed to the device, in order: the caller may schedule the
        next one before it takes this one's result (--async-scheduling)."""
        out = self.runner.execute(so)
        return StepHandle(out, self.runner.step_event())

    def shutdown(self) -> None:
        pass


def make_executor(config: FolioConfig):
    if config.parallel.world_size == 1:
        return UniProcExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from folio.worker.ray_executor import RayExecutor
        return RayExecutor(config)
    from folio.worker.multiproc import MultiprocExecutor
    return MultiprocExecutor(config)
