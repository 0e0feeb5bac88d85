"""Frames between the front processes and the engine core: a 4-byte length, then one `marshal`ed tuple
`(op, id, *args)` of plain values (str, int, float, bool, None, bytes, lists, tuples, dicts).

marshal was measured against msgpack and JSON on a one-pair request and its reply: encoding and decoding
both takes 6.0 us of CPU with marshal, 6.2 with msgpack, 19 with JSON (Zen 4, docs/fronts-bench.md). Both
ends are this same program, so marshal's version coupling costs nothing. A `Channel` is an asyncio protocol:
it parses frames as bytes arrive (no stream-reader round trips) and hands each to its owner's `on_frame`.

Errors cross as `(class name, message, attributes)` and are rebuilt as the same runtime class, so the one
error map (service.http.errors) sees in a front exactly what it would see in one process.
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import struct
from collections.abc import Callable

log = logging.getLogger("qtrel.wire")

HEADER = struct.Struct("<I")
MAX_FRAME = 256 * 2**20  # a 4 MiB body tokenises to far less; anything larger is a broken peer
MARSHAL_VERSION = 4


def pack(frame: tuple) -> bytes:
    body = marshal.dumps(frame, MARSHAL_VERSION)
    return HEADER.pack(len(body)) + body


class Channel(asyncio.Protocol):
    """One end of a connection: `send(frame)`; each frame received goes to `on_frame(frame)`, and the
    connection's end to `on_close()`."""

    def __init__(self, on_frame: Callable[[tuple], None], on_close: Callable[[], None] = lambda: None):
        self.on_frame = on_frame
        self.on_close = on_close
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # get_running_loop costs a getpid call on 3.11
        self._buf = bytearray()
        self._out: list[bytes] = []  # frames sent in this turn of the event loop: one write for them all
        self._lists: dict[str, list] = {}  # items of this turn's one frame per op (send_item)
        self.closed = asyncio.Event()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        n = len(buf)
        while n - start >= 4:
            (size,) = HEADER.unpack_from(buf, start)
            if size > MAX_FRAME:
                log.error("frame of %d bytes refused: closing the connection", size)
                self.close()
                return
            end = start + 4 + size
            if end > n:
                break
            frame = marshal.loads(memoryview(buf)[start + 4 : end])
            start = end
            try:
                self.on_frame(frame)
            except Exception:  # one bad frame must not end the connection
                log.exception("frame %r failed", frame[:1])
        if start:
            del buf[:start]

    def connection_lost(self, exc) -> None:
        self.closed.set()
        self.on_close()

    def send(self, frame: tuple) -> None:
        """Queue a frame; the frames of one turn of the event loop go out in one write (one system call
        for the replies to a whole batch)."""
        if not self._out and not self._lists:
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)
        self._out.append(pack(frame))

    def send_item(self, op: str, item: tuple) -> None:
        """Queue `item` for the one `(op, 0, [items])` frame of this turn of the event loop: the requests
        (or replies) of a turn cross as one frame, unpacked by one `marshal.loads`."""
        if not self._out and not self._lists:
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)
        if (items := self._lists.get(op)) is None:
            items = self._lists[op] = []
        items.append(item)

    def _flush(self) -> None:
        lists, self._lists = self._lists, {}
        out = [pack((op, 0, items)) for op, items in lists.items()]  # first: a cancel follows its request
        out += self._out
        self._out = []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# --- errors -----------------------------------------------------------------------------------
def dump_error(e: BaseException) -> tuple:
    """An exception as plain values: its class name, message and marshal-able attributes."""
    attrs = {}
    for k, v in getattr(e, "__dict__", {}).items():
        try:
            marshal.dumps(v)
        except ValueError:
            continue
        attrs[k] = v
    return (type(e).__name__, str(e), attrs)


def load_error(dumped: tuple, known: dict[str, type[BaseException]]) -> BaseException:
    """The exception `dump_error` described, as its own class where `known` has it (else RuntimeError)."""
    name, message, attrs = dumped
    cls = known.get(name)
    if cls is None:
        return RuntimeError(f"{name}: {message}")
    e = cls.__new__(cls)
    BaseException.__init__(e, message)
    e.__dict__.update(attrs)
    return e


def error_classes(*classes: type[BaseException]) -> dict[str, type[BaseException]]:
    return {c.__name__: c for c in classes}
