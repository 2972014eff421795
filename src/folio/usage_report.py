"""`folio usage` and GET /v1/usage: the usage ledger summed by tenant, day,
model or LoRA adapter ('' for requests of the base model).

Plain Python and sqlite3 only: the command runs without torch and without a
server, on the ledger file a server writes (`--usage-db`), even while that
server writes it (WAL: readers do not block the writer).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
from typing import Optional

GROUPS = {"tenant": "tenant", "model": "model",
          "day": "strftime('%Y-%m-%d', time, 'unixepoch')",
          "adapter": "COALESCE(adapter, '')"}


def since_timestamp(text: Optional[str]) -> Optional[float]:
    """YYYY-MM-DD (00:00 UTC) or an ISO date-time (UTC unless it says otherwise)."""
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"since: expected a date such as 2026-12-01 or "
                         f"2026-12-01T08:00:00, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def usage_rows(path: str, since: Optional[str] = None, by: str = "tenant") -> list[dict]:
    if by not in GROUPS:
        raise ValueError(f"by: expected one of {', '.join(GROUPS)}, got {by!r}")
    start = since_timestamp(since)
    if not os.path.exists(path):
        raise ValueError(f"no usage ledger at {path}")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        group = GROUPS[by]
        if by == "adapter" and "adapter" not in {
                row[1] for row in db.execute("PRAGMA table_info(usage)")}:
            group = "''"           # a ledger from before adapters, not opened since
        rows = db.execute(
            f"SELECT {group} AS key, COUNT(*), SUM(prompt_tokens), "
            f"SUM(cached_prompt_tokens), SUM(completion_tokens), SUM(aborted), SUM(cost) "
            f"FROM usage WHERE time >= ? GROUP BY key ORDER BY key",
            (start if start is not None else float("-inf"),)).fetchall()
    except sqlite3.Error as e:
        raise ValueError(f"{path} is not a Folio usage ledger: {e}") from None
    finally:
        db.close()
    return [{by: key, "requests": n, "prompt_tokens": p, "cached_prompt_tokens": c,
             "completion_tokens": o, "aborted": a, "cost": cost}
            for key, n, p, c, o, a, cost in rows]


def table(rows: list[dict], by: str) -> str:
    lines = [f"| {by} | requests | prompt tokens | cached | completion tokens | aborted | cost ($) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cost = "-" if r["cost"] is None else f"{r['cost']:.6f}"
        lines.append(f"| {r[by]} | {r['requests']} | {r['prompt_tokens']} | "
                     f"{r['cached_prompt_tokens']} | {r['completion_tokens']} | "
                     f"{r['aborted']} | {cost} |")
    if rows:
        total_cost = [r["cost"] for r in rows if r["cost"] is not None]
        lines.append(f"| all | {sum(r['requests'] for r in rows)} | "
                     f"{sum(r['prompt_tokens'] for r in rows)} | "
                     f"{sum(r['cached_prompt_tokens'] for r in rows)} | "
                     f"{sum(r['completion_tokens'] for r in rows)} | "
                     f"{sum(r['aborted'] for r in rows)} | "
                     f"{f'{sum(total_cost):.6f}' if total_cost else '-'} |")
    return "\n".join(lines)


def cmd_usage(args) -> int:
    rows = usage_rows(args.db, args.since, args.by)
    print(json.dumps(rows) if args.json else table(rows, args.by))
    return 0
