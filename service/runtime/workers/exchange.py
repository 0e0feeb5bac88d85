"""One request and its reply over a model process's pipe, driven by the event loop without ever blocking it.

`multiprocessing.Connection.send` and `recv` return only once a whole message is written or read: right on a
replica's thread, wrong on the event loop, which would stall for as long as a model process is slow to be
scheduled, stopped (SIGSTOP) or kept from reading a request or writing a reply larger than the socket's
buffer. Here the loop writes the request with MSG_DONTWAIT (the rest, if the buffer fills, whenever the socket
turns writable) and reads the reply one non-blocking `recv` each time it turns readable, until it is whole.

The bytes are Connection's own (CPython 3.8+ `_send_bytes`/`_recv_bytes`): a 4-byte big-endian signed length,
or -1 then an 8-byte length for a message over 2 GiB, then the pickle. So the model process, and the
replica's thread when it drives the same pipe, read and write them with a plain Connection.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

NOWAIT = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
FIRST_READ = 65536  # a reply's first read: a batch's scores (~150 bytes a pair) come whole in one
_SIZE = struct.Struct("!i")
_HUGE = struct.Struct("!Q")  # after a size of -1
_MAX_SIZE = 0x7FFFFFFF
Finish = Callable[[Any, BaseException | None], None]  # (reply, error)


class OutOfStep(OSError):
    """The pipe no longer holds whole messages in turn (more bytes than one reply, or a request half sent
    that cannot be completed): only a new model process, with a new pipe, serves again."""


def frame(message: Any) -> bytes:
    """`message` pickled and framed as Connection.send frames it."""
    payload = ForkingPickler.dumps(message)
    n = len(payload)
    head = _SIZE.pack(n) if n <= _MAX_SIZE else _SIZE.pack(-1) + _HUGE.pack(n)
    return head + payload


class Reader:
    """One framed message, taken as it arrives (`read`), unpickled once whole (`message`)."""

    __slots__ = ("_got", "_head", "_payload")

    def __init__(self) -> None:
        self._head = b""  # what arrived before the payload's size was known
        self._payload: bytearray | memoryview | None = None
        self._got = 0

    def read(self, sock: socket.socket) -> bool:
        """One `recv` that cannot block; True once the message is whole. EOFError: the writer is gone;
        BlockingIOError: nothing to read after all (call again when readable)."""
        payload = self._payload
        if payload is not None:  # a long message: straight into its buffer
            n = sock.recv_into(memoryview(payload)[self._got :], 0, NOWAIT)
            if not n:
                raise EOFError
            self._got += n
            return self._got == len(payload)
        chunk = sock.recv(FIRST_READ, NOWAIT)
        if not chunk:
            raise EOFError
        head = self._head = self._head + chunk if self._head else chunk
        if len(head) < _SIZE.size:
            return False
        (size,) = _SIZE.unpack_from(head)
        start = _SIZE.size
        if size == -1:
            start += _HUGE.size
            if len(head) < start:
                return False
            (size,) = _HUGE.unpack_from(head, _SIZE.size)
        rest = memoryview(head)[start:]
        if len(rest) > size:
            raise OutOfStep(f"{len(rest) - size} bytes beyond the reply")
        if len(rest) == size:  # the common case: the whole reply in the first read
            self._payload, self._got = rest, size
            return True
        self._payload = bytearray(size)
        self._payload[: len(rest)] = rest
        self._got = len(rest)
        self._head = b""
        return False

    def message(self) -> Any:
        assert self._payload is not None and self._got == len(self._payload)
        return ForkingPickler.loads(self._payload)


class Exchange:
    """Writes one framed request to `sock` and reads one framed reply, on `loop`; then, on the loop,
    `finish(reply, None)`, or `finish(None, error)`: EOFError or OSError if the other end went away (OutOfStep
    if the pipe cannot be used again), or what unpickling the reply raised. At most one at a time per socket."""

    __slots__ = ("_fd", "_finish", "_loop", "_reader", "_rest", "_sock")

    def __init__(self, loop: Any, sock: socket.socket, finish: Finish):
        self._loop, self._sock, self._finish = loop, sock, finish
        self._fd = sock.fileno()
        self._rest: memoryview | None = None
        self._reader = Reader()

    def start(self, message: Any) -> None:
        """Send `message` (as much as the socket takes now) and return. A message that does not pickle raises
        here, with nothing sent."""
        data = frame(message)
        try:
            sent = self._sock.send(data, NOWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._loop.call_soon(self._finish, None, e)
            return
        if sent < len(data):  # the socket's buffer is full: the rest when the model process has read some
            self._rest = memoryview(data)[sent:]
            self._watch(self._loop.add_writer, self._writable)
        else:
            self._watch(self._loop.add_reader, self._readable)

    def _watch(self, add: Callable[..., None], callback: Callable[[], None]) -> None:
        try:
            add(self._fd, callback)
        except Exception as e:  # e.g. the loop is closing: the request was (partly) sent, its reply not read
            self._loop.call_soon(self._finish, None, OutOfStep(f"cannot watch the pipe: {e!r}"))

    def _writable(self) -> None:
        assert self._rest is not None
        try:
            sent = self._sock.send(self._rest, NOWAIT)
        except BlockingIOError:
            return
        except OSError as e:
            self._loop.remove_writer(self._fd)
            self._finish(None, e)
            return
        self._rest = self._rest[sent:]
        if not self._rest:
            self._loop.remove_writer(self._fd)
            self._rest = None
            self._watch(self._loop.add_reader, self._readable)

    def _readable(self) -> None:
        try:
            if not self._reader.read(self._sock):
                return
        except BlockingIOError:
            return
        except (EOFError, OSError) as e:
            self._loop.remove_reader(self._fd)
            self._finish(None, e)
            return
        self._loop.remove_reader(self._fd)
        try:
            reply = self._reader.message()
        except Exception as e:  # the reply was read whole: the pipe stays in step
            self._finish(None, e)
            return
        self._finish(reply, None)
