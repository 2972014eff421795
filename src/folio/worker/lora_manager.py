"""The runner's LoRA adapters (issue 31): loaded from their PEFT folders on
first use and kept, least recently used evicted past max_cpu_loras; put in
one of the layers' max_loras slots when a step needs them (the scheduler
never schedules more distinct adapters in one step), least recently used
slot first; and the step's token groups set for the layers
(model/lora/layers.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch

from folio.config import FolioConfig
from folio.lora_request import LoRARequest
from folio.model.lora.checkpoint import LoRAAdapter, load_peft_adapter
from folio.model.lora.layers import attach_lora, load_into_slot


class LoRAManager:
    def __init__(self, model, config: FolioConfig, dtype: torch.dtype, device):
        lc = config.lora
        self.base, self.max_rank, self.device = config.model, lc.max_lora_rank, device
        self.context, self.layers = attach_lora(model, lc.max_loras, lc.max_lora_rank, dtype,
                                                device)
        self.modules = {m for layer in self.layers for m in layer.modules.values()}
        self.cpu_limit = max(lc.max_cpu_loras or lc.max_loras, lc.max_loras)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()   # by lora_int_id, LRU
        self.slot_of: dict[int, int] = {}
        self.holder: list[Optional[int]] = [None] * lc.max_loras      # lora id in each slot
        self.used: list[int] = [0] * lc.max_loras                     # step it last ran
        self.step = 0
        # a server checks adapters on its own thread while the engine steps
        self._lock = threading.Lock()

    def adapter(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of `req`, loaded and checked on first use (a ValueError
        naming what does not fit)."""
        with self._lock:
            return self._adapter(req)

    def _adapter(self, req: LoRARequest) -> LoRAAdapter:
        got = self.adapters.get(req.lora_int_id)
        if got is not None and (got.name, got.path) != (req.lora_name, req.lora_path):
            raise ValueError(f"lora_int_id {req.lora_int_id} is adapter {got.name!r} "
                             f"({got.path}); {req.lora_name!r} needs an id of its own")
        if got is None:
            got = load_peft_adapter(req.lora_name, req.lora_path, self.base, self.max_rank)
            missing = sorted(m for m in got.modules if m not in self.modules)
            if missing:
                raise ValueError(f"LoRA adapter {req.lora_name!r}: {missing[0]} is not an "
                                 "adapted layer of this model")
            self.adapters[req.lora_int_id] = got
            while len(self.adapters) > self.cpu_limit:
                old, _ = self.adapters.popitem(last=False)
                if old in self.slot_of:
                    self.holder[self.slot_of.pop(old)] = None
        self.adapters.move_to_end(req.lora_int_id)
        return got

    def prepare_step(self, runs: list[tuple[LoRARequest, int, int]]) -> None:
        """The step's runs of rows of each adapter (adapter, first row, end):
        their slots, for the layers."""
        self.step += 1
        with self._lock:
            self.context.set([(self._slot(req), start, end) for req, start, end in runs],
                             len(self.holder), self.device)

    def end_step(self) -> None:
        self.context.clear()

    def _slot(self, req: LoRARequest) -> int:
        adapter = self._adapter(req)
        slot = self.slot_of.get(req.lora_int_id)
        if slot is None:
            free = [i for i in range(len(self.holder)) if self.used[i] < self.step]
            if not free:
                raise RuntimeError("more adapters in one step than max_loras slots")
            slot = min(free, key=lambda i: (self.holder[i] is not None, self.used[i]))
            if self.holder[slot] is not None:
                del self.slot_of[self.holder[slot]]
            load_into_slot(self.layers, slot, adapter)
            self.holder[slot], self.slot_of[req.lora_int_id] = req.lora_int_id, slot
        self.used[slot] = self.step
        return slot


def lora_key(lora: Optional[LoRARequest]) -> int:
    """Where a sequence's rows go in a step laid out by adapter (0: none)."""
    return 0 if lora is None else lora.lora_int_id


def lora_runs(seqs: list[tuple[Optional[LoRARequest], int]]) -> list:
    """The step's runs of consecutive rows of one adapter, (adapter, first row,
    end), from each sequence's (adapter, rows) in the order the rows are laid."""
    runs: list = []
    row = 0
    for lora, n in seqs:
        if lora is not None:
            if runs and runs[-1][0] == lora and runs[-1][2] == row:
                runs[-1] = (lora, runs[-1][1], row + n)
            else:
                runs.append((lora, row, row + n))
        row += n
    return runs

