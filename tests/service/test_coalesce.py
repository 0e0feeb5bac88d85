"""One socket write per response (service.coalesce), on real sockets and a real uvicorn server."""

from __future__ import annotations

import asyncio
import socket

import uvloop

from service.coalesce import FLUSH_BYTES, TurnTransport


class Sink(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport


async def pair():
    """(TurnTransport over a real socket, the socket at the other end, non-blocking)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    transport, _ = await loop.create_connection(Sink, sock=a)
    b.setblocking(False)
    return TurnTransport(transport, loop), b


def received(sock: socket.socket) -> list[bytes]:
    """Each recv's bytes until nothing more is waiting."""
    out = []
    while True:
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        if not data:
            return out
        out.append(data)


def test_writes_of_one_turn_leave_as_one_and_in_order():
    async def main():
        t, b = await pair()
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        assert t.get_write_buffer_size() == 23  # held, counted for flow control
        assert received(b) == []  # nothing sent before the turn ends
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert received(b) == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        t.write(b"next")
        await asyncio.sleep(0.01)
        assert received(b) == [b"next"]
        t.close()
        b.close()

    uvloop.run(main())


def test_close_sends_what_is_held_and_abort_drops_it():
    async def main():
        t, b = await pair()
        t.write(b"last words")
        t.close()
        await asyncio.sleep(0.01)
        assert b"".join(received(b)) == b"last words"
        assert t.is_closing()
        b.close()
        t, b = await pair()
        t.write(b"dropped")
        t.abort()
        await asyncio.sleep(0.01)
        assert received(b) == []
        b.close()

    uvloop.run(main())


def test_a_large_body_is_written_at_once():
    async def main():
        t, b = await pair()
        t.write(b"x" * (FLUSH_BYTES + 1))
        assert t.get_write_buffer_size() < FLUSH_BYTES  # handed to the real transport, not held to the turn's end
        await asyncio.sleep(0.01)
        assert len(b"".join(received(b))) == FLUSH_BYTES + 1
        t.close()
        b.close()

    uvloop.run(main())


def test_the_live_server_answers_pipelined_requests_whole_and_in_order(server):
    """Two requests on one connection, sent at once: both answers arrive whole, the first first."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    first, second = data.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and b'"status"' in first.partition(b"\r\n\r\n")[2]
    assert second.startswith(b"404")
