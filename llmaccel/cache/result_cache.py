"""ResultCache: an exact response cache for deterministic requests.

A request whose output is a function of its input (greedy, or sampled with a fixed seed; one
sample) is keyed by a hash of the model variant, its prompt token ids (after the chat template) and
every sampling field. The value is the engine's whole output stream for it, so a hit can be
replayed chunk by chunk exactly as it was first streamed. Entries live in memory, least recently
used first out when either `max_entries` or `max_bytes` is passed; with a `path` they are also
written to SQLite (WAL mode), so hits survive a restart (a memory miss reads the database). Entries
older than `ttl_s` are misses, and the database drops them on open and every 1,000 writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from llmaccel.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmaccel.sampling_params import SamplingParams


def is_cacheable(params: SamplingParams) -> bool:
    """Only a deterministic request has one right answer to remember (prompt logprobs are not kept)."""
    return params.n == 1 and (params.greedy or params.seed is not None) and params.prompt_logprobs is None


def cache_key(variant: str, prompt_token_ids: list[int], params: SamplingParams) -> str:
    fields = dataclasses.asdict(params)
    payload = json.dumps({"variant": variant, "prompt": prompt_token_ids, "params": fields}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class ResultCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ResultCache:
    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20, path: Path | None = None,
                 ttl_s: float | None = None) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the result cache needs max_entries >= 1 and max_bytes >= 1")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"the result cache TTL must be > 0 seconds, got {ttl_s}")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.stats = ResultCacheStats()
        self.bytes = 0
        self._memory: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # key -> (JSON, created)
        self._lock = threading.Lock()
        self._db = _open(path) if path is not None else None
        self._puts = 0
        self._prune()

    def __len__(self) -> int:
        return len(self._memory)

    def get(self, key: str) -> list[RequestOutput] | None:
        """The cached output stream, or None (counting a hit or a miss)."""
        with self._lock:
            entry = self._memory.get(key)
            if entry is None and self._db is not None:
                row = self._db.execute("SELECT payload, created FROM results WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    entry = (bytes(row[0]), row[1])
                    self._remember(key, *entry)
            if entry is not None and self._expired(entry[1]):
                self._forget(key)
                entry = None
            if entry is None:
                self.stats.misses += 1
                return None
            self._memory.move_to_end(key)
            self.stats.hits += 1
            return _decode(entry[0])

    def put(self, key: str, outputs: list[RequestOutput]) -> None:
        payload, created = _encode(outputs), time.time()
        if len(payload) > self.max_bytes:
            return  # larger than the whole cache: not worth evicting everything for
        with self._lock:
            self._remember(key, payload, created)
            if self._db is not None:
                with self._db:
                    self._db.execute("INSERT OR REPLACE INTO results (key, payload, created) VALUES (?, ?, ?)",
                                     (key, payload, created))
                self._puts += 1
                if self._puts % 1000 == 0:
                    self._prune()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _prune(self) -> None:
        """Drop expired rows from the database (on open, then every 1,000 writes)."""
        if self._db is not None and self.ttl_s is not None:
            with self._db:
                self._db.execute("DELETE FROM results WHERE created < ?", (time.time() - self.ttl_s,))

    def _expired(self, created: float) -> bool:
        return self.ttl_s is not None and time.time() - created > self.ttl_s

    def _remember(self, key: str, payload: bytes, created: float) -> None:
        if key in self._memory:
            self.bytes -= len(self._memory.pop(key)[0])
        self._memory[key] = (payload, created)
        self.bytes += len(payload)
        while len(self._memory) > self.max_entries or self.bytes > self.max_bytes:
            _, (old, _) = self._memory.popitem(last=False)
            self.bytes -= len(old)
            self.stats.evictions += 1

    def _forget(self, key: str) -> None:
        entry = self._memory.pop(key, None)
        if entry is not None:
            self.bytes -= len(entry[0])
        if self._db is not None:
            with self._db:
                self._db.execute("DELETE FROM results WHERE key = ?", (key,))


def _open(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE IF NOT EXISTS results "
               "(key TEXT PRIMARY KEY, payload BLOB NOT NULL, created REAL NOT NULL)")
    return db


def _encode(outputs: list[RequestOutput]) -> bytes:
    return json.dumps([dataclasses.asdict(o) for o in outputs], separators=(",", ":")).encode()


def _decode(payload: bytes) -> list[RequestOutput]:
    out = []
    for item in json.loads(payload):
        completions = []
        for c in item["outputs"]:
            logprobs = None if c["logprobs"] is None else [
                Logprob(lp["token_id"], lp["logprob"], {int(k): v for k, v in lp["top"].items()})
                for lp in c["logprobs"]]
            completions.append(CompletionOutput(**{**c, "logprobs": logprobs}))
        out.append(RequestOutput(**{**item, "outputs": completions, "metrics": RequestMetrics(**item["metrics"])}))
    return out
