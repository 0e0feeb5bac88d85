"""API keys: those listed in the settings (`api_keys`) and those of the key file (`api_keys_file`), each with
an id that names it in the metrics without being it. The key file is re-read when it changes, so keys rotate
without a restart: on the request path, checked at most once a second (`refresh`), or at once (`reload`, for
SIGHUP). A file that cannot be read, or holds no key, when it is re-read keeps the last good keys serving and
is logged once; at start it refuses the settings (the server would otherwise start open while its operator
believes it locked).

The keys are swapped as one tuple, so `reload` is safe from a signal handler while a request is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("qtrel.keys")

KEY_ID_HEX = 12  # hex digits of SHA-256 in a key's id: 48 bits, no collision among any real set of keys
CHECK_EVERY_S = 1.0  # how often the request path looks at the key file's stat


def key_id(key: str) -> str:
    """What the metrics call a key: the first 12 hex digits of its SHA-256 (`printf %s KEY | sha256sum`)."""
    return hashlib.sha256(_raw(key)).hexdigest()[:KEY_ID_HEX]


def split_keys(text: str, sep: str) -> tuple[str, ...]:
    """Keys separated by `sep`, stripped; empty ones dropped, and in a file lines that start with #."""
    keys = (p.strip() for p in text.split(sep))
    return tuple(k for k in keys if k and not (sep == "\n" and k.startswith("#")))


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys of a key file: one a line, blank lines and # comments ignored. ValueError, saying why, when
    it cannot be read or holds no key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api_keys_file {str(path)!r} cannot be read: {type(e).__name__}: {e}") from None
    keys = split_keys(text, "\n")
    if not keys:
        raise ValueError(
            f"api_keys_file {str(path)!r} holds no key (one a line; blank lines and # comments are ignored)"
        )
    return keys


def _raw(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _stamp(path: Path) -> tuple:
    """What tells that the file changed: inode (a Kubernetes Secret update swaps it), size and times."""
    try:
        st = os.stat(path)
    except OSError as e:
        return ("unreadable", e.errno)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeyRing:
    """The keys in force, and the file they partly come from. Empty: authentication is off."""

    def __init__(
        self,
        listed: tuple[str, ...],
        path: Path | None,
        check_every_s: float = CHECK_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = path
        self._listed = listed
        self._every = check_every_s
        self._clock = clock
        self._seen = _stamp(path) if path is not None else None  # taken before reading: a later change is seen
        self._entries = _entries(listed + (read_key_file(path) if path is not None else ()))
        self._checked = clock()
        self._failure: str | None = None  # the last re-read's error, logged once
        self.generation = 0  # counts the changes of the keys in force

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k, _, _ in self._entries)

    @property
    def ids(self) -> tuple[str, ...]:
        """The ids of the keys in force, each once."""
        return tuple(dict.fromkeys(i for _, _, i in self._entries))

    def match(self, given: str) -> str | None:
        """The id of the key `given` is, or None. Constant time: compared with every key, no early exit, so
        timing tells nothing of which key (or how much of one) matched."""
        g = _raw(given)
        found = None
        for _, raw, kid in self._entries:  # one tuple: a reload meanwhile swaps it, never changes it
            if hmac.compare_digest(g, raw) and found is None:
                found = kid
        return found

    def refresh(self) -> None:
        """Re-read the key file if it changed since it was last looked at; looks at most every
        `check_every_s` seconds (a stat: microseconds)."""
        if self.path is None:
            return
        now = self._clock()
        if now - self._checked < self._every:
            return
        self._checked = now
        stamp = _stamp(self.path)
        if stamp != self._seen:
            self._seen = stamp
            self.reload()

    def reload(self) -> None:
        """Re-read the key file now (SIGHUP). If it cannot be read or holds no key, the last good keys stay in
        force and the error is logged (once while it lasts)."""
        if self.path is None:
            return
        try:
            entries = _entries(self._listed + read_key_file(self.path))
        except ValueError as e:
            if str(e) != self._failure:
                self._failure = str(e)
                log.error("%s; the %d keys read before stay in force", e, len(self._entries))
            return
        self._failure = None
        if [i for _, _, i in entries] != [i for _, _, i in self._entries]:
            self._entries = entries
            self.generation += 1
            log.info("API keys re-read from %s: %d in force", self.path, len(entries))


def _entries(keys: tuple[str, ...]) -> tuple[tuple[str, bytes, str], ...]:
    return tuple((k, _raw(k), key_id(k)) for k in keys)
