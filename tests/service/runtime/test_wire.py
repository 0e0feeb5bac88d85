"""The frames between fronts and the engine core, and the runtime's errors crossing them."""

from __future__ import annotations

from service.runtime.batcher import Overloaded
from service.runtime.engine import InputTooLong, NotReady
from service.runtime.wire import Channel, dump_error, error_classes, load_error, pack


def test_frames_split_anywhere_arrive_whole_and_in_order():
    got: list[tuple] = []
    ch = Channel(got.append)
    frames = [("score", 1, {"ids": [[101, 7, 102]], "queries": ["q"]}), ("ok", 2, b"\x00" * 5000), ("cancel", 3)]
    data = b"".join(pack(f) for f in frames)
    for i in range(0, len(data), 7):  # arriving in 7-byte pieces
        ch.data_received(data[i : i + 7])
    assert got == frames


def test_an_error_crosses_as_its_own_class_with_its_attributes():
    known = error_classes(Overloaded, NotReady, InputTooLong)
    e = load_error(dump_error(Overloaded("pairs", 3.0)), known)
    assert isinstance(e, Overloaded) and e.retry_after == 3.0 and str(e) == str(Overloaded("pairs", 3.0))
    e = load_error(dump_error(NotReady("draining")), known)
    assert isinstance(e, NotReady) and e.why == "draining"
    assert str(load_error(dump_error(InputTooLong(2, 128)), known)) == str(InputTooLong(2, 128))
    unknown = load_error(dump_error(KeyError("x")), known)
    assert type(unknown) is RuntimeError and "KeyError" in str(unknown)
