"""Token buckets keyed by who sends (a job, a peer): the job events' rate limits.

One bucket per daemon let a single process flooding ``POST /v1/events`` spend the
allowance of every job on the node, so an honest job's ``durable`` event was dropped
(issue 22, weak point 1). Each key has its own bucket now, and the number of keys is
bounded: the least recently heard is forgotten first (it starts full when heard again).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, TypeVar

__all__ = ["KeyedBuckets", "TokenBucket"]

Key = TypeVar("Key")


class TokenBucket:
    """``burst`` tokens at most, ``rate`` more a second; one token per event."""

    def __init__(self, rate: float, burst: float, monotonic: Callable[[], float]) -> None:
        self._rate, self._burst, self._monotonic = rate, burst, monotonic
        self._tokens = burst
        self._at = monotonic()

    def ready(self) -> bool:
        """Whether a token is there (refilled for the time since the last look)."""
        now = self._monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        return self._tokens >= 1.0

    def spend(self) -> None:
        self._tokens -= 1.0

    def take(self) -> bool:
        if not self.ready():
            return False
        self.spend()
        return True


class KeyedBuckets(Generic[Key]):
    """One :class:`TokenBucket` per key, for at most ``keys`` keys (least recently used
    forgotten first). Not thread-safe: the caller holds its own lock."""

    def __init__(self, rate: float, burst: float, keys: int,
                 monotonic: Callable[[], float]) -> None:
        self._rate, self._burst, self._keys, self._monotonic = rate, burst, keys, monotonic
        self._buckets: OrderedDict[Key, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def bucket(self, key: Key) -> TokenBucket:
        """The key's bucket, made the most recently used (a new key's is full)."""
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = TokenBucket(self._rate, self._burst, self._monotonic)
        self._buckets[key] = bucket
        while len(self._buckets) > self._keys:
            self._buckets.popitem(last=False)
        return bucket
