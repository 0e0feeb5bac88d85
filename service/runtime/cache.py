"""The pair-score cache: what the model returned for a pair, keyed by everything that determines it.

A key is the model's name and load generation, the truncation mode and side, `max_length`, the query and
the title: the same key always means the same token ids through the same weights, so a hit returns exactly
what a forward would. The value is the pair's row as the model process packed it (model.levels.pack_row: its
level, logits, probabilities and expected level, floats as doubles, bit for bit) followed by its token count,
truncation flag and unknown share: one `bytes`, ~330 bytes an entry plus its texts instead of ~1 KB of Python lists
and floats. A hit hands the row on as it is (the engine core sends it to a front process, which unpacks it).

Bounded by bytes (each entry charged its measured size, `entry_bytes`), least recently used out first.
It knows nothing of HTTP, torch or the batcher; the engine uses it on the event loop only (no locks).
"""

from __future__ import annotations

import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass

# What an entry costs beyond its texts and packed value, measured with tracemalloc on 100k entries (201
# bytes; tests/service/runtime/test_cache.py holds the charge to the traced memory): the key tuple (7
# slots), the OrderedDict's hash slot and its linked-list node.
ENTRY_OVERHEAD = 208

Key = tuple[str, int, str, str, int, str, str]


def make_key(model: str, generation: int, truncation: str, side: str, max_length: int, query: str, title: str) -> Key:
    return (model, generation, truncation, side, max_length, query, title)


@dataclass(frozen=True, slots=True)
class Cached:
    """A pair as the model scored it, and as the tokenizer saw it."""

    row: bytes  # its scores (model.levels.pack_row)
    length: int  # tokens, special tokens included
    truncated: bool
    unknown: float  # the share of its text the model cannot read (EncodedPairs.unknown)


# after the row: the unknown share as float64 (exact for a Python float), the length, the truncation flag
_TAIL = struct.Struct("<dH?")


class ScoreCache:
    """An LRU of `Cached` bounded by `max_bytes` (0: off, every lookup a miss, nothing stored)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Key, bytes] = OrderedDict()
        self.bytes = 0  # the charge of the entries held
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Cached | None:
        packed = self._entries.get(key)
        if packed is None:
            return None
        self._entries.move_to_end(key)
        return self._unpack(packed)

    def put(self, key: Key, value: Cached) -> int:
        """Store (or refresh) a pair; returns how many entries were evicted to make room."""
        if not self.enabled:
            return 0
        packed = self._pack(value)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= entry_bytes(key, old)
        size = entry_bytes(key, packed)
        if size > self.max_bytes:
            return 0
        self._entries[key] = packed
        self.bytes += size
        evicted = 0
        while self.bytes > self.max_bytes:
            k, v = self._entries.popitem(last=False)
            self.bytes -= entry_bytes(k, v)
            evicted += 1
        self.evictions += evicted
        return evicted

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def describe(self) -> dict:
        return {
            "enabled": self.enabled,
            "max_bytes": self.max_bytes,
            "bytes": self.bytes,
            "entries": len(self._entries),
            "evictions": self.evictions,
            "policy": "lru",
        }

    @staticmethod
    def _pack(c: Cached) -> bytes:
        return c.row + _TAIL.pack(c.unknown, c.length, c.truncated)

    @staticmethod
    def _unpack(packed: bytes) -> Cached:
        end = len(packed) - _TAIL.size
        unknown, length, truncated = _TAIL.unpack_from(packed, end)
        return Cached(packed[:end], length, truncated, unknown)


def entry_bytes(key: Key, packed: bytes) -> int:
    """What one entry is charged: its query and title strings, its packed value and the fixed overhead
    (the model name and the options are shared by every entry and not charged)."""
    return sys.getsizeof(key[5]) + sys.getsizeof(key[6]) + sys.getsizeof(packed) + ENTRY_OVERHEAD
