"""The event loop's exchange over a model process's pipe: the bytes are multiprocessing.Connection's own, both
ways, whole or in pieces, and the loop is never blocked by a peer that reads or writes slowly."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest

from service.runtime.workers.exchange import Exchange, OutOfStep, Reader, frame


def pair():
    """(our socket, the peer's Connection): a Pipe, as the process backend makes one."""
    ours, theirs = mp.Pipe()
    sock = socket.fromfd(ours.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    ours.close()
    return sock, theirs


@pytest.mark.parametrize("size", [0, 100, 20_000, 3_000_000])
def test_frames_are_connections_own_both_ways(size):
    sock, peer = pair()
    try:
        message = {"n": size, "blob": b"x" * size}
        got = []
        peer_reader = threading.Thread(target=lambda: got.append(peer.recv()))
        peer_reader.start()
        sock.sendall(frame(message))
        peer_reader.join(30)
        assert got == [message]  # a Connection reads what the loop writes
        peer_sender = threading.Thread(target=peer.send, args=(message,))  # blocks while the buffer is full
        peer_sender.start()
        reader = Reader()
        while True:
            try:
                if reader.read(sock):
                    break
            except BlockingIOError:
                time.sleep(0.001)
        peer_sender.join()
        assert reader.message() == message
    finally:
        sock.close()
        peer.close()


def test_the_long_header_and_a_header_in_pieces_are_read():
    """Above 2 GiB Connection writes -1 then an 8-byte length; any piece may arrive alone."""
    sock, peer = pair()
    try:
        payload = ForkingPickler.dumps(["long", "header"])
        data = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + bytes(payload)
        reader = Reader()
        for piece in (data[:2], data[2:7], data[7:20], data[20:]):
            _write_raw(peer, piece)
            done = reader.read(sock)
        assert done and reader.message() == ["long", "header"]
    finally:
        sock.close()
        peer.close()


def test_bytes_beyond_one_reply_put_the_pipe_out_of_step():
    sock, peer = pair()
    try:
        _write_raw(peer, frame("one") + frame("two"))
        with pytest.raises(OutOfStep):
            Reader().read(sock)
    finally:
        sock.close()
        peer.close()


def _write_raw(conn, data: bytes) -> None:
    conn._send(data)  # Connection's own unframed write


def test_the_loop_ticks_while_a_large_request_and_its_reply_cross_slowly():
    """The peer reads the request and writes the reply in small pieces, pausing between them: the exchange
    takes a second and more, the loop is never held more than a few milliseconds of it."""
    sock, peer = pair()
    request = list(range(300_000))  # ~1.5 MB framed: several times the socket's buffer
    reply = ["scores"] * 200_000

    def slow_peer():
        head = struct.unpack("!i", _read_exactly(peer, 4))[0]
        got = bytearray()
        while len(got) < head:
            got += _read_exactly(peer, min(131072, head - len(got)))
            time.sleep(0.05)
        assert ForkingPickler.loads(got) == request
        data = frame(reply)
        for i in range(0, len(data), 131072):
            _write_raw(peer, data[i : i + 131072])
            time.sleep(0.05)

    async def main():
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        ticks = []

        async def tick():
            while not finished.done():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.002)

        ticking = asyncio.ensure_future(tick())
        Exchange(loop, sock, lambda r, e: finished.set_result((r, e))).start(request)
        got, error = await asyncio.wait_for(finished, 30)
        await ticking
        return got, error, ticks

    t = threading.Thread(target=slow_peer)
    t.start()
    try:
        got, error, ticks = asyncio.run(main())
    finally:
        t.join(30)
        sock.close()
        peer.close()
    assert error is None and got == reply
    assert ticks[-1] - ticks[0] > 0.5 and max(b - a for a, b in zip(ticks, ticks[1:])) < 0.25


def test_a_peer_that_goes_away_ends_the_exchange_with_eof():
    sock, peer = pair()

    async def main():
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        Exchange(loop, sock, lambda r, e: finished.set_result((r, e))).start("ping")
        assert peer.recv() == "ping"
        _write_raw(peer, struct.pack("!i", 1000) + b"partial")
        peer.close()
        return await asyncio.wait_for(finished, 10)

    try:
        reply, error = asyncio.run(main())
    finally:
        sock.close()
    assert reply is None and isinstance(error, EOFError)


def _read_exactly(conn, n: int) -> bytes:
    return conn._recv(n).getvalue()  # Connection's own unframed read
