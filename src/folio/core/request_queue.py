"""The waiting queue, in the order the scheduling policy admits requests.

fcfs:     arrival order; a preempted request goes back to the front.
priority: lower `priority` first, then arrival; a request's effective priority
          improves by one for every `aging_steps` steps it has waited, so a
          stream of more urgent arrivals cannot hold it back forever.

Admission is head-of-line in both: when the first request does not fit, nobody
behind it jumps ahead (that would starve long prompts behind short ones).
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

from folio.request import Request


class RequestQueue:
    def __init__(self, policy: str = "fcfs", aging_steps: int = 0):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self.aging_steps = aging_steps
        self._items: deque[Request] = deque()
        self._step = 0
        self._since: dict[str, int] = {}     # request id -> step it (re)entered the queue

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def add(self, req: Request) -> None:
        self._since[req.request_id] = self._step
        self._items.append(req)

    def add_preempted(self, req: Request) -> None:
        self._since[req.request_id] = self._step
        self._items.appendleft(req)
        if self.policy == "priority":
            self._sort()

    def remove(self, req: Request) -> None:
        self._items.remove(req)
        self._since.pop(req.request_id, None)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        req = self._items.popleft()
        self._since.pop(req.request_id, None)
        return req

    def key(self, req: Request) -> tuple:
        """Sort key: smaller runs first (also used to pick preemption victims)."""
        if self.policy == "fcfs":
            return (req.arrival_time,)
        aged = 0
        if self.aging_steps and req.request_id in self._since:
            aged = (self._step - self._since[req.request_id]) // self.aging_steps
        return (req.priority - aged, req.arrival_time)

    def tick(self) -> None:
        """Once per scheduler step: restore the policy's order."""
        self._step += 1
        if self.policy == "priority":
            self._sort()

    def _sort(self) -> None:
        if len(self._items) > 1:
            self._items = deque(sorted(self._items, key=self.key))
