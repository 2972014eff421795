"""Live cost: what a token costs on this running server, from `--cost-per-hour`.

The machine costs its hourly price whether it is busy or idle, so the cost of
the last `window_s` seconds (300, or since start when shorter) is spread over
the tokens processed in them. A prompt token is weighted `prompt_weight`
(`--prompt-token-weight`, 0.25) of an output token, as hosted APIs price
input at about a quarter of output: output cost per 1K = 1000 x window cost
/ (weight x prompt tokens + output tokens), prompt cost per 1K = weight x
that. A ledger row's cost is its own tokens at those rates when it is
written, so tenants share the machine by their weighted tokens. With no
token in the window the figures are undefined (NaN on /metrics).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Optional


def per_1k_tokens(cost_per_hour: float, seconds: float, prompt_tokens: float,
                  output_tokens: float, prompt_weight: float) -> tuple[float, float]:
    """(prompt, output) dollars per 1,000 tokens when `seconds` of the machine
    served those tokens; NaN without tokens. Also `folio bench serve`'s, from a
    run's throughput (one second of it)."""
    units = prompt_weight * prompt_tokens + output_tokens
    if units <= 0:
        return math.nan, math.nan
    per_output = 1000.0 * cost_per_hour * seconds / 3600.0 / units
    return prompt_weight * per_output, per_output


class CostMeter:
    def __init__(self, cost_per_hour: float, prompt_weight: float = 0.25,
                 window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        if not cost_per_hour > 0 or not prompt_weight >= 0 or not window_s > 0:
            raise ValueError("the cost per hour and the window must be > 0, the prompt "
                             "weight >= 0")
        self.cost_per_hour, self.prompt_weight, self.window_s = (cost_per_hour, prompt_weight,
                                                                 window_s)
        self._clock = clock
        self._start = clock()
        self._events: deque = deque()          # (time, prompt tokens, output tokens)
        self._totals = [0, 0]                  # the window's prompt and output tokens
        self._lock = threading.Lock()

    def add(self, prompt_tokens: int, output_tokens: int) -> None:
        """One engine step's new tokens (the metrics add them once a step)."""
        if prompt_tokens or output_tokens:
            with self._lock:
                self._events.append((self._clock(), prompt_tokens, output_tokens))
                self._totals[0] += prompt_tokens
                self._totals[1] += output_tokens

    def per_1k(self) -> tuple[float, float]:
        """(prompt, output) dollars per 1,000 tokens over the window; NaN without tokens."""
        now = self._clock()
        with self._lock:
            while self._events and self._events[0][0] <= now - self.window_s:
                _, p, o = self._events.popleft()
                self._totals[0] -= p
                self._totals[1] -= o
            prompt, output = self._totals
        span = min(self.window_s, max(now - self._start, 1e-9))
        return per_1k_tokens(self.cost_per_hour, span, prompt, output, self.prompt_weight)

    def cost_of(self, prompt_tokens: int, output_tokens: int) -> Optional[float]:
        per_prompt, per_output = self.per_1k()
        if math.isnan(per_output):
            return None
        return (per_prompt * prompt_tokens + per_output * output_tokens) / 1000.0
