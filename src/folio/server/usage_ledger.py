"""The usage ledger: one SQLite row per finished request, written by one thread.

Handlers hand a row to `record` and, for a request that completed, wait for
its commit before the last bytes of the response go out: so after a `kill -9`
every response a client received whole is in the ledger. Rows are committed
in batches (whatever arrived while the last commit ran, up to 512), off the
engine's thread and the event loop. WAL mode with synchronous=NORMAL: a
committed row survives the process dying; only an OS crash or power loss may
lose the last commits. The request id is the primary key and rows are
inserted with INSERT OR IGNORE, so a row is in the ledger at most once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from concurrent.futures import Future
from dataclasses import astuple, dataclass
from typing import Optional

logger = logging.getLogger("folio")
BATCH = 512

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY,
    time REAL NOT NULL,                 -- when the request finished, Unix seconds
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    finish_reason TEXT,
    aborted INTEGER NOT NULL,
    cost REAL,                          -- dollars, with --cost-per-hour; else NULL
    adapter TEXT                        -- the LoRA adapter the request named; else NULL
);
CREATE INDEX IF NOT EXISTS usage_time ON usage (time);
"""


@dataclass(frozen=True)
class UsageRow:
    request_id: str
    time: float
    tenant: str
    model: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    latency_s: float
    finish_reason: Optional[str]
    aborted: bool
    cost: Optional[float] = None
    adapter: Optional[str] = None


COLUMNS = ("request_id, time, tenant, model, prompt_tokens, cached_prompt_tokens, "
           "completion_tokens, latency_s, finish_reason, aborted, cost, adapter")


def connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=5000")
    db.executescript(SCHEMA)
    # a ledger written before LoRA adapters (issue 31) gains their column
    if "adapter" not in {row[1] for row in db.execute("PRAGMA table_info(usage)")}:
        with db:
            db.execute("ALTER TABLE usage ADD COLUMN adapter TEXT")
    return db


class UsageLedger:
    def __init__(self, path: str):
        try:
            self._db = connect(path)
        except sqlite3.Error as e:
            raise ValueError(f"--usage-db {path}: {e}") from None
        self.path = path
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="folio-ledger", daemon=True)
        self._thread.start()

    def submit(self, row: UsageRow, replace: bool = False) -> Future:
        """Queue a row; the future is done once its batch is committed. `replace`:
        the row replaces one of the same id (a completion cancelled while it
        committed becomes an abort). After close, the row is written at once."""
        done: Future = Future()
        with self._lock:
            if not self._closed:
                self._queue.put((row, done, replace))
                return done
        db = connect(self.path)              # a late row, after shutdown began
        try:
            self._commit(db, [(row, done, replace)])
        finally:
            db.close()
        return done

    async def record(self, row: UsageRow) -> None:
        """Queue a row and wait for its commit (the handler's last step before it answers)."""
        await asyncio.wrap_future(self.submit(row))

    def close(self) -> None:
        """Commit what is queued and stop the writer; later rows are written at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch            # nothing is queued after the sentinel
            self._commit(self._db, [item for item in batch if item is not None])
        self._db.close()

    @staticmethod
    def _commit(db: sqlite3.Connection, batch) -> None:
        if not batch:
            return
        try:
            with db:
                for verb, rows in (("INSERT OR IGNORE", [r for r, _, rep in batch if not rep]),
                                   ("INSERT OR REPLACE", [r for r, _, rep in batch if rep])):
                    if rows:
                        db.executemany(f"{verb} INTO usage ({COLUMNS}) VALUES "
                                       f"(?,?,?,?,?,?,?,?,?,?,?,?)",
                                       [astuple(row) for row in rows])
        except Exception as e:              # noqa: BLE001 - the writer must not die
            logger.error("the usage ledger could not commit %d rows: %s", len(batch), e)
            for _, done, _ in batch:
                _resolve(done, RuntimeError(f"the usage ledger failed: {e}"))
            return
        for _, done, _ in batch:
            _resolve(done, None)


def _resolve(done: Future, error: Optional[BaseException]) -> None:
    if done.set_running_or_notify_cancel():      # False: its waiter was cancelled
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
