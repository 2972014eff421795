"""What the engine asks of an executor about rank 0's runner, shared by every
executor (each keeps rank 0's runner in the engine's process)."""

from __future__ import annotations


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
