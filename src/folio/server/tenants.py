"""Tenants: who a bearer key belongs to, and the limits each tenant is held to.

`--api-keys-file FILE` (JSON, or YAML when PyYAML is there) holds
`{"keys": [{"key": "sk-..." | "key_sha256": "<hex>", "tenant": "team-a",
"requests_per_minute": 60, "tokens_per_minute": 20000, "tokens_per_day":
1000000, "admin": false, "adapters": ["sql-lora"]}]}`; limits are optional;
`adapters` limits the key to those LoRA adapters (others are 404 as if
absent; the base model stays open), and a tenant's keys agree on it. Keys are kept only as
SHA-256 digests in memory. `--api-key KEY` is
one anonymous tenant with no limits; with neither, every caller is that
tenant and nothing is asked.

Limits are checked when a request is admitted (its prompt tokens are known,
its completion is at most max_tokens): requests in the last 60 s, tokens in
the last 60 s and tokens since 00:00 UTC, each with this request's prompt
and max_tokens counted, as OpenAI's rate limits count them (an estimate above
a limit counts as the limit; a prompt alone above it is a 400). A refused
request is a 429 with Retry-After and is charged nothing. An admitted request holds
its estimate until it finishes, when the estimate is replaced by the tokens
it really used (an aborted request pays for what it generated).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

ANONYMOUS = "anonymous"
WINDOW_S = 60.0
_FIELDS = {"key", "key_sha256", "tenant", "requests_per_minute", "tokens_per_minute",
           "tokens_per_day", "admin", "adapters"}


@dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_minute: Optional[int] = None
    tokens_per_minute: Optional[int] = None
    tokens_per_day: Optional[int] = None
    admin: bool = False
    adapters: Optional[frozenset] = None     # LoRA adapters it may name (None: every one)

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


class RateLimited(Exception):
    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyBook:
    """Bearer key -> Tenant; None when no key is asked for at all."""

    def __init__(self, by_digest: dict[str, Tenant]):
        self._by_digest = by_digest

    @classmethod
    def from_config(cls, api_key: Optional[str], keys_file: Optional[str]) -> Optional["KeyBook"]:
        book: dict[str, Tenant] = {}
        if keys_file:
            book.update(read_keys_file(keys_file))
        if api_key:
            book[digest(api_key)] = Tenant(ANONYMOUS)
        return cls(book) if book else None

    def tenant_for(self, authorization: str) -> Optional[Tenant]:
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        # Looked up by digest: what a lookup's timing could leak is about the
        # SHA-256 of the key tried, which tells nothing of any real key.
        return self._by_digest.get(digest(key.strip()))


def read_keys_file(path: str) -> dict[str, Tenant]:
    """Digest -> Tenant, every entry checked; a bad file is one clear ValueError."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror}") from None
    data = _parse(path, text)
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--api-keys-file {path}: expected {{\"keys\": [{{\"key\": ..., "
                         f"\"tenant\": ...}}, ...]}}")
    book: dict[str, Tenant] = {}
    for i, e in enumerate(entries):
        where = f"--api-keys-file {path}: keys[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where} is not an object")
        unknown = sorted(set(e) - _FIELDS)
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown} (known: {sorted(_FIELDS)})")
        if ("key" in e) == ("key_sha256" in e):
            raise ValueError(f"{where} needs one of 'key' and 'key_sha256'")
        if "key" in e:
            if not isinstance(e["key"], str) or not e["key"]:
                raise ValueError(f"{where}: 'key' must be a non-empty string")
            d = digest(e["key"])
        else:
            d = str(e["key_sha256"]).lower()
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"{where}: 'key_sha256' must be 64 hex digits")
        name = e.get("tenant")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where} needs a 'tenant' name")
        limits = {}
        for k in ("requests_per_minute", "tokens_per_minute", "tokens_per_day"):
            v = e.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{where}: '{k}' must be a whole number >= 1, got {v!r}")
            limits[k] = v
        adapters = e.get("adapters")
        if adapters is not None:
            if not isinstance(adapters, list) or not all(isinstance(a, str) and a
                                                         for a in adapters):
                raise ValueError(f"{where}: 'adapters' must be a list of adapter names, got "
                                 f"{adapters!r}")
            adapters = frozenset(adapters)
        if d in book:
            raise ValueError(f"{where}: the same key is listed twice")
        book[d] = Tenant(name.strip(), admin=bool(e.get("admin", False)), adapters=adapters,
                         **limits)
    _check_consistent(path, book)
    return book


def _parse(path: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--api-keys-file {path} is not JSON ({json_error}); YAML "
                             f"needs PyYAML") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--api-keys-file {path} is neither JSON nor YAML: {e}") from None


def _check_consistent(path: str, book: dict[str, Tenant]) -> None:
    """A tenant's keys share one set of limits and adapters: two keys must not disagree."""
    seen: dict[str, Tenant] = {}
    for tenant in book.values():
        other = seen.setdefault(tenant.name, tenant)
        if (other.requests_per_minute, other.tokens_per_minute, other.tokens_per_day) != (
                tenant.requests_per_minute, tenant.tokens_per_minute, tenant.tokens_per_day):
            raise ValueError(f"--api-keys-file {path}: tenant {tenant.name!r} has keys with "
                             f"different limits")
        if other.adapters != tenant.adapters:
            raise ValueError(f"--api-keys-file {path}: tenant {tenant.name!r} has keys with "
                             f"different adapters")


@dataclass
class _Usage:
    requests: deque = field(default_factory=deque)      # admission times
    tokens: deque = field(default_factory=deque)        # (time, tokens), charged
    day: int = -1
    day_tokens: int = 0


class Limiter:
    """Per-tenant request and token windows. Thread-safe; `clock` for tests."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}

    def admit(self, tenant: Tenant, estimate: int, prompt: int = 0) -> "Admission":
        """Charge one request and `estimate` tokens, or raise RateLimited (charging
        nothing). A request whose prompt alone exceeds a token limit can never run
        (ValueError); an estimate above a limit counts as the limit (max_tokens
        defaults to the context's room, which may exceed a small limit)."""
        for limit, what in ((tenant.tokens_per_minute, "tokens per minute"),
                            (tenant.tokens_per_day, "tokens per day")):
            if limit is not None:
                if prompt > limit:
                    raise ValueError(f"the prompt has {prompt} tokens, more than tenant "
                                     f"{tenant.name!r}'s {limit} {what}")
                estimate = min(estimate, limit)
        now = self._clock()
        with self._lock:
            u = self._usage.setdefault(tenant.name, _Usage())
            self._expire(u, now)
            rpm, tpm, tpd = (tenant.requests_per_minute, tenant.tokens_per_minute,
                             tenant.tokens_per_day)
            if rpm is not None and len(u.requests) + 1 > rpm:
                raise RateLimited(f"tenant {tenant.name!r} is over its limit of {rpm} requests "
                                  f"per minute", u.requests[0] + WINDOW_S - now)
            if tpm is not None:
                used = sum(n for _, n in u.tokens)
                if used + estimate > tpm:
                    raise RateLimited(f"tenant {tenant.name!r} is over its limit of {tpm} "
                                      f"tokens per minute ({used} used in the last minute, "
                                      f"this request may use {estimate})",
                                      self._tokens_free_at(u, used + estimate - tpm) - now)
            if tpd is not None and u.day_tokens + estimate > tpd:
                raise RateLimited(f"tenant {tenant.name!r} is over its limit of {tpd} tokens "
                                  f"per day ({u.day_tokens} used today, this request may use "
                                  f"{estimate})", (u.day + 1) * 86400 - now)
            entry = [now, estimate]
            u.requests.append(now)
            u.tokens.append(entry)
            u.day_tokens += estimate
            return Admission(self, tenant.name, entry, u.day, prompt)

    def _settle(self, name: str, entry: list, day: int, used: int) -> None:
        with self._lock:
            u = self._usage[name]
            if u.day == day:
                u.day_tokens += used - entry[1]
            entry[1] = used

    def _expire(self, u: _Usage, now: float) -> None:
        while u.requests and u.requests[0] <= now - WINDOW_S:
            u.requests.popleft()
        while u.tokens and u.tokens[0][0] <= now - WINDOW_S:
            u.tokens.popleft()
        day = int(now // 86400)
        if day != u.day:
            u.day, u.day_tokens = day, 0

    @staticmethod
    def _tokens_free_at(u: _Usage, excess: int) -> float:
        freed = 0
        for t, n in u.tokens:
            freed += n
            if freed >= excess:
                return t + WINDOW_S
        return u.tokens[-1][0] + WINDOW_S if u.tokens else 0.0


@dataclass
class Admission:
    """What an admitted request holds; `settle` once with the tokens it used. Its
    prompt counts whatever it used: a client that leaves before the first output
    (nothing seen, nothing billed) still sent it, or leaving at once after each
    long prompt would get round the token limits."""
    limiter: Limiter
    tenant: str
    entry: list
    day: int
    prompt: int = 0
    settled: bool = False

    def settle(self, used: int) -> None:
        if not self.settled:
            self.settled = True
            self.limiter._settle(self.tenant, self.entry, self.day, max(used, self.prompt))
