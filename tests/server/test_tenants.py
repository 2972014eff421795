"""Tenants, their limits, the live cost and the usage ledger, without a server:
the keys file and its errors, the limiter's windows on a fake clock (a refused
request charges nothing), the cost arithmetic by hand, and the SQLite ledger
(batches, at most once per request id, read back by `folio usage`)."""

import dataclasses
import json
import math
import sqlite3
import threading

import pytest

from folio.cli import main
from folio.server.cost import CostMeter
from folio.server.tenants import (ANONYMOUS, KeyBook, Limiter, RateLimited, Tenant, digest,
                                  read_keys_file)
from folio.server.usage_ledger import UsageLedger, UsageRow
from folio.usage_report import usage_rows


class Clock:
    def __init__(self, t: float = 1_764_547_200.0):     # 2025-12-01 00:00 UTC
        self.t = t

    def __call__(self) -> float:
        return self.t


def keys_file(tmp_path, entries, name="keys.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


def test_a_keys_file_maps_keys_and_their_digests_to_tenants(tmp_path):
    path = keys_file(tmp_path, [
        {"key": "sk-a1", "tenant": "team-a", "requests_per_minute": 60},
        {"key_sha256": digest("sk-b1").upper(), "tenant": "team-b", "tokens_per_day": 1000},
        {"key": "sk-admin", "tenant": "ops", "admin": True},
        {"key": "sk-c1", "tenant": "team-c", "adapters": ["sql"]}])
    book = KeyBook.from_config("sk-plain", path)
    c = book.tenant_for("Bearer sk-c1")
    assert c.adapters == {"sql"} and c.may_use("sql") and not c.may_use("chat")
    assert book.tenant_for("Bearer sk-a1").may_use("chat")     # no "adapters": every one
    assert book.tenant_for("Bearer sk-a1") == Tenant("team-a", requests_per_minute=60)
    assert book.tenant_for("Bearer sk-b1") == Tenant("team-b", tokens_per_day=1000)
    assert book.tenant_for("Bearer sk-admin").admin is True
    assert book.tenant_for("Bearer sk-plain") == Tenant(ANONYMOUS)      # --api-key
    for bad in ("Bearer sk-nope", "sk-a1", "Basic sk-a1", "", "Bearer "):
        assert book.tenant_for(bad) is None
    assert "sk-a1" not in repr(book.__dict__)            # only digests are kept
    assert KeyBook.from_config(None, None) is None       # no key asked at all


def test_yaml_keys_files_are_read_too(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - key: sk-y\n    tenant: team-y\n    tokens_per_minute: 500\n")
    assert read_keys_file(str(path)) == {digest("sk-y"): Tenant("team-y", tokens_per_minute=500)}


@pytest.mark.parametrize("entries, message", [
    ([{"tenant": "a"}], "needs one of 'key' and 'key_sha256'"),
    ([{"key": "k", "key_sha256": "0" * 64, "tenant": "a"}], "needs one of"),
    ([{"key": "k"}], "needs a 'tenant'"),
    ([{"key": "k", "tenant": "a", "rpm": 3}], "unknown fields ['rpm']"),
    ([{"key": "k", "tenant": "a", "requests_per_minute": 0}], "whole number >= 1"),
    ([{"key": "k", "tenant": "a", "tokens_per_day": 1.5}], "whole number >= 1"),
    ([{"key_sha256": "abc", "tenant": "a"}], "64 hex digits"),
    ([{"key": "k", "tenant": "a"}, {"key": "k", "tenant": "b"}], "listed twice"),
    ([{"key": "k1", "tenant": "a", "tokens_per_minute": 5},
      {"key": "k2", "tenant": "a", "tokens_per_minute": 6}], "different limits"),
    ([{"key": "k", "tenant": "a", "adapters": "sql"}], "'adapters' must be a list"),
    ([{"key": "k", "tenant": "a", "adapters": ["sql", 3]}], "'adapters' must be a list"),
    ([{"key": "k1", "tenant": "a", "adapters": ["sql"]},
      {"key": "k2", "tenant": "a"}], "different adapters"),
    ([], "expected"),
])
def test_a_bad_keys_file_is_one_clear_error(tmp_path, entries, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_keys_file(keys_file(tmp_path, entries))


def test_requests_per_minute_refuses_with_retry_after_and_charges_nothing():
    clock = Clock()
    limiter, tenant = Limiter(clock), Tenant("t", requests_per_minute=2)
    limiter.admit(tenant, 10)
    clock.t += 20
    limiter.admit(tenant, 10)
    clock.t += 10
    for _ in range(3):                  # refused again and again: nothing is counted
        with pytest.raises(RateLimited) as e:
            limiter.admit(tenant, 10)
        assert e.value.retry_after == 30          # the first leaves the window at +60 s
    clock.t += 30                       # t = 60: the first request has left the window
    limiter.admit(tenant, 10)
    with pytest.raises(RateLimited):
        limiter.admit(tenant, 10)


def test_tokens_are_estimated_at_admission_and_settled_at_the_end():
    clock = Clock()
    limiter, tenant = Limiter(clock), Tenant("t", tokens_per_minute=1000)
    a = limiter.admit(tenant, 600)                # prompt + max_tokens
    with pytest.raises(RateLimited, match="600 used"):
        limiter.admit(tenant, 500)
    a.settle(250)                                 # it used 250: 750 are free again
    b = limiter.admit(tenant, 500)
    b.settle(500)
    b.settle(0)                                   # settling twice changes nothing
    with pytest.raises(RateLimited) as e:
        limiter.admit(tenant, 400)                # 750 used: 150 over
    assert e.value.retry_after == 60              # the first entry (250) frees enough at +60
    with pytest.raises(ValueError, match="the prompt has 1001 tokens, more than tenant 't'"):
        limiter.admit(tenant, 1100, prompt=1001)  # can never run: a 400, not a 429
    clock.t += 61                                 # the window is empty again
    big = limiter.admit(tenant, 5000, prompt=10)  # max_tokens past the limit: counts as 1000
    with pytest.raises(RateLimited):
        limiter.admit(tenant, 1, prompt=1)
    big.settle(40)
    limiter.admit(tenant, 900, prompt=10)


def test_a_request_left_before_its_first_output_still_counts_its_prompt():
    limiter, tenant = Limiter(Clock()), Tenant("t", tokens_per_minute=1000)
    limiter.admit(tenant, 900, prompt=700).settle(0)     # nothing seen: the prompt was sent
    with pytest.raises(RateLimited, match="700 used"):
        limiter.admit(tenant, 400, prompt=350)


def test_a_prompt_longer_than_the_days_tokens_is_a_400_not_a_429_until_midnight():
    limiter, tenant = Limiter(Clock()), Tenant("t", tokens_per_day=100)
    with pytest.raises(ValueError, match="100 tokens per day"):
        limiter.admit(tenant, 150, prompt=120)


def test_tokens_per_day_reset_at_midnight_utc():
    clock = Clock(1_764_547_200.0 + 86400 - 100)          # 100 s before midnight
    limiter, tenant = Limiter(clock), Tenant("t", tokens_per_day=100)
    limiter.admit(tenant, 80).settle(90)
    with pytest.raises(RateLimited) as e:
        limiter.admit(tenant, 20)
    assert e.value.retry_after == 100
    clock.t += 100
    limiter.admit(tenant, 100)


def test_the_cost_per_token_is_the_machines_hour_over_weighted_tokens():
    clock = Clock(0.0)
    meter = CostMeter(3.6, prompt_weight=0.25, window_s=300, clock=clock)   # $0.001 a second
    assert all(math.isnan(v) for v in meter.per_1k())                      # no token yet
    clock.t = 100.0
    meter.add(1000, 1000)
    # $0.10 over 0.25 x 1000 + 1000 = 1250 weighted tokens: $0.08 per 1K output, $0.02 prompt
    prompt, output = meter.per_1k()
    assert (prompt, output) == (pytest.approx(0.02), pytest.approx(0.08))
    assert meter.cost_of(400, 100) == pytest.approx(0.4 * 0.02 + 0.1 * 0.08)
    clock.t = 1000.0                  # the tokens left the 300 s window
    assert math.isnan(meter.per_1k()[1]) and meter.cost_of(1, 1) is None
    meter.add(0, 3000)                # a full window: $0.30 over 3000 tokens
    assert meter.per_1k()[1] == pytest.approx(0.1)


def row(rid, tenant, t, prompt=10, completion=5, cost=0.001, model="m"):
    return UsageRow(rid, t, tenant, model, prompt, 2, completion, 0.5, "length", False, cost)


def test_the_ledger_commits_in_batches_once_per_request_and_sums_by_group(tmp_path, capsys):
    path = str(tmp_path / "usage.db")
    ledger = UsageLedger(path)
    day1, day2 = 1_764_547_200.0, 1_764_547_200.0 + 86400
    futures = [ledger.submit(row(f"r{i}", "a" if i % 2 else "b", day1 + i)) for i in range(100)]
    futures += [ledger.submit(row("r1", "a", day1, prompt=999))]     # the same id again
    futures += [ledger.submit(row("late", "a", day2, model="m2", cost=None))]
    for f in futures:
        f.result(10)
    ledger.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.execute("SELECT COUNT(*), SUM(prompt_tokens) FROM usage").fetchone() == (101, 1010)
    by_tenant = usage_rows(path, by="tenant")
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["completion_tokens"])
            for r in by_tenant] == [("a", 51, 510, 255), ("b", 50, 500, 250)]
    assert by_tenant[0]["cost"] == pytest.approx(0.050)        # NULL costs add nothing
    assert [r["day"] for r in usage_rows(path, by="day")] == ["2025-12-01", "2025-12-02"]
    assert [r["model"] for r in usage_rows(path, since="2025-12-02", by="model")] == ["m2"]
    assert main(["usage", "--db", path, "--by", "tenant", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_tenant
    assert main(["usage", "--db", path]) == 0
    out = capsys.readouterr().out
    assert "| a | 51 | 510 |" in out and "| all | 101 | 1010 |" in out


def test_a_ledger_from_before_adapters_gains_their_column(tmp_path):
    """A ledger written before LoRA adapters has no `adapter` column: `folio
    usage --by adapter` reads it as the base model's, and a server opening it
    adds the column and writes adapters there."""
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE usage (request_id TEXT PRIMARY KEY, time REAL NOT NULL, "
               "tenant TEXT NOT NULL, model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
               "cached_prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
               "latency_s REAL NOT NULL, finish_reason TEXT, aborted INTEGER NOT NULL, "
               "cost REAL)")
    db.execute("INSERT INTO usage VALUES ('r0', 1.0, 'a', 'm', 10, 0, 5, 0.1, 'stop', 0, NULL)")
    db.commit()
    db.close()
    assert [(r["adapter"], r["requests"]) for r in usage_rows(path, by="adapter")] == [("", 1)]
    ledger = UsageLedger(path)
    ledger.submit(row("r1", "a", 2.0)).result(10)
    ledger.submit(dataclasses.replace(row("r2", "a", 3.0), adapter="sql")).result(10)
    ledger.close()
    assert [(r["adapter"], r["requests"]) for r in usage_rows(path, by="adapter")] == [
        ("", 2), ("sql", 1)]


@pytest.mark.parametrize("args, message", [
    (["--since", "yesterday"], "expected a date"), (["--db", "/nonexistent.db"], "no usage ledger")])
def test_folio_usage_errors_are_one_line(tmp_path, capsys, args, message):
    path = str(tmp_path / "u.db")
    UsageLedger(path).close()
    argv = ["usage", "--db", path, *args] if "--db" not in args else ["usage", *args]
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_rows_after_close_are_written_at_once_and_a_replace_turns_a_row_into_an_abort(tmp_path):
    path = str(tmp_path / "u.db")
    ledger = UsageLedger(path)
    ledger.submit(row("r1", "a", 1.0)).result(10)
    ledger.close()
    ledger.submit(row("late", "a", 2.0)).result(10)          # after shutdown began
    aborted = UsageRow("r1", 3.0, "a", "m", 10, 2, 5, 0.5, "abort", True, None)
    ledger.submit(aborted, replace=True).result(10)
    rows = sqlite3.connect(path).execute(
        "SELECT request_id, aborted, finish_reason FROM usage ORDER BY request_id").fetchall()
    assert rows == [("late", 0, "length"), ("r1", 1, "abort")]


def test_a_row_the_database_refuses_fails_its_future_and_the_writer_lives_on(tmp_path):
    ledger = UsageLedger(str(tmp_path / "u.db"))
    with pytest.raises(RuntimeError, match="the usage ledger failed"):
        ledger.submit(row("huge", "a", 1.0, prompt=2**70)).result(10)    # too big for SQLite
    ledger.submit(row("fine", "a", 1.0)).result(10)
    ledger.close()
    assert [r["requests"] for r in usage_rows(str(tmp_path / "u.db"))] == [1]


def test_concurrent_writers_each_see_their_own_commit(tmp_path):
    ledger = UsageLedger(str(tmp_path / "u.db"))
    errors = []

    def write(k):
        try:
            for i in range(50):
                ledger.submit(row(f"{k}-{i}", f"t{k}", 1.0)).result(10)
        except Exception as e:        # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    assert not errors
    assert [r["requests"] for r in usage_rows(str(tmp_path / "u.db"))] == [50, 50, 50, 50]
