"""Executors: where the model runner lives. One process, or (tensor parallel)
rank 0 here and N - 1 worker processes over torch.distributed, behind the same
execute / shutdown API (worker/multiproc.py)."""

from __future__ import annotations

from folio.config import FolioConfig
from folio.core.outputs import ModelRunnerOutput, SchedulerOutput


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
        return self._out


class RunnerFacts:
    """What the engine asks of rank 0's runner (every executor keeps it in this
    process): asked here, so the engine reaches no further than its executor."""

    runner = None

    @property
    def bytes_per_block(self) -> int:
        """A KV block's bytes on a rank (a draft model's share included)."""
        return self.runner.bytes_per_block

    @property
    def draft_bytes_per_block(self) -> int:
        drafter = self.runner.drafter
        return drafter.bytes_per_block if drafter is not None else 0

    def check_lora(self, lora_request) -> None:
        """The adapter loaded and checked against the model (ValueError)."""
        self.runner.loras.adapter(lora_request)


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
