"""The backend contract: the state machine, the messages, the model side (runner) and both backends on
the real tiny checkpoint."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
import time

import pytest

from model.explain import explain_pair
from model.levels import unpack_rows
from model.relevance import RelevanceModel
from service.runtime.workers import runner
from service.runtime.workers.backend import (
    TRANSITIONS,
    Error,
    Forward,
    IllegalTransition,
    Job,
    Loaded,
    LoadFailed,
    LoadSpec,
    ModelError,
    ProcessDied,
    Result,
    State,
    StateMachine,
    Stop,
)
from service.runtime.workers.backend_thread import ThreadBackend
from tests.service.runtime.workers.hooked import HookedProcessBackend, answer


# --- the state machine --------------------------------------------------------------------------
def test_every_state_has_its_transitions_and_stopped_is_final():
    assert set(TRANSITIONS) == set(State)
    assert TRANSITIONS[State.STOPPED] == frozenset()
    for state, targets in TRANSITIONS.items():
        assert state not in targets
        if state != State.STOPPED:
            assert State.STOPPING in targets or State.STOPPED in targets, state


def test_state_machine_follows_the_table_and_reports_changes():
    seen = []
    m = StateMachine(on_change=lambda old, new: seen.append((old, new)))
    assert m.state == State.LOADING
    assert m.advance(State.WARMING) and m.advance(State.READY) and m.advance(State.RESTARTING)
    assert m.advance(State.READY)
    assert not m.advance(State.READY)  # no change, no report
    with pytest.raises(IllegalTransition, match="ready -> loading"):
        m.advance(State.LOADING)
    assert seen == [
        (State.LOADING, State.WARMING),
        (State.WARMING, State.READY),
        (State.READY, State.RESTARTING),
        (State.RESTARTING, State.READY),
    ]


def test_stopping_wins_every_race():
    m = StateMachine()
    assert m.advance(State.STOPPING) and m.ending
    assert m.advance(State.READY) is False  # e.g. a restart that finished after stop began
    assert m.state == State.STOPPING
    assert m.advance(State.STOPPED) and m.advance(State.FAILED) is False


def test_wait_for_returns_when_the_state_arrives_or_the_timeout_passes():
    m = StateMachine()
    assert m.wait_for({State.READY}, timeout=0.05) == State.LOADING
    threading.Timer(0.1, lambda: m.advance(State.READY)).start()
    t0 = time.monotonic()
    assert m.wait_for({State.READY, State.FAILED}, timeout=10) == State.READY
    assert time.monotonic() - t0 < 5


# --- messages -----------------------------------------------------------------------------------
def test_messages_are_frozen_and_pickle():
    for message in (
        Forward([([101, 102], [0, 0])]),
        Job("explain", ("q", "t"), {"top_heads": 3}),
        Loaded({"name": "x"}),
        Result([1.0]),
        Error("ValueError", "boom"),
    ):
        assert pickle.loads(pickle.dumps(message)) == message
        with pytest.raises(dataclasses.FrozenInstanceError):
            message.__setattr__(dataclasses.fields(message)[0].name, None)


# --- the model side -----------------------------------------------------------------------------
def test_model_process_hands_memory_back_once_idle(tiny_checkpoint, monkeypatch):
    """The model process's loop (child_main, here on a thread over a real pipe): after a job and IDLE_TRIM_S
    without another, the memory its batches freed goes back to the OS, once; not while jobs keep coming, and
    not again until one has run."""
    import multiprocessing as mp

    from service.runtime.workers import backend_process

    trims: list[float] = []
    monkeypatch.setattr(backend_process, "release_free_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(backend_process, "IDLE_TRIM_S", 0.3)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # a process's own business, refused off the main thread
    ours, theirs = mp.Pipe()

    def reply():
        assert ours.poll(60), "no reply from the model loop"
        return ours.recv()

    child = threading.Thread(target=backend_process.child_main, args=(theirs, LoadSpec(str(tiny_checkpoint))))
    child.start()
    try:
        assert isinstance(reply(), Loaded)
        batch = Forward([([101, 7, 102, 8, 102], [0, 0, 0, 1, 1])])
        for _ in range(4):  # jobs 0.1 s apart: never idle long enough
            ours.send(batch)
            assert isinstance(reply(), Result)
            answered = time.monotonic()
            time.sleep(0.1)
        assert trims == []
        time.sleep(0.8)
        assert len(trims) == 1 and trims[0] - answered >= 0.25  # once, after the idle time
        time.sleep(0.5)
        assert len(trims) == 1  # nothing ran since
        ours.send(batch)
        assert isinstance(reply(), Result)
        time.sleep(0.8)
        assert len(trims) == 2
    finally:
        ours.send(Stop())
        child.join(10)
    assert not child.is_alive()


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return RelevanceModel.load(tiny_checkpoint)


def test_forward_is_the_models_one_scoring_call(model, tiny_checkpoint):
    enc = model.tokenizer.encode(["drill", "drill"], ["cordless drill", "deck stain"])
    reply = runner.handle(model, LoadSpec(str(tiny_checkpoint)), Forward(list(zip(enc.input_ids, enc.token_type_ids))))
    assert isinstance(reply, Result)
    rows, seconds = reply.value  # the batch's rows packed, one bytes: nothing for the server to rebuild
    assert isinstance(rows, bytes) and seconds > 0
    want = model.score(model.logits(enc.input_ids, enc.token_type_ids))
    assert unpack_rows(rows, 2) == want.rows()  # bit for bit


def test_jobs_are_looked_up_by_name(model, tiny_checkpoint):
    spec = LoadSpec(str(tiny_checkpoint))
    assert runner.resolve_job("explain") is explain_pair
    assert answer(model, spec, Job("labels_of")) == Result(["1", "2", "3", "4", "5"])  # the test backend's
    assert answer(model, spec, Job("raise_value_error", ("boom",))) == Error("ValueError", "boom")
    unknown = runner.handle(model, spec, Job("labels_of"))  # the production side knows no test job
    assert isinstance(unknown, Error) and unknown.type == "KeyError" and "labels_of" in unknown.message


# --- the two backends ---------------------------------------------------------------------------
def test_thread_backend_keeps_the_contract(tiny_checkpoint, tmp_path):
    b = ThreadBackend(LoadSpec(str(tiny_checkpoint), warmup=False))
    assert not b.health().alive
    described = b.load()
    b.warm_up()
    assert described["labels"] == ["1", "2", "3", "4", "5"] and b.health().alive
    assert b.pid is None and b.in_flight() is None
    out = b.job("explain", ("cordless drill", "DEWALT cordless drill"), {"top_heads": 2})
    heads = out["term_matching_heads"]  # the pair shares "cordless" and "drill": top_heads of them, best first
    assert len(heads) == 2 and heads[0]["score"] >= heads[1]["score"]
    with pytest.raises(ModelError, match="IndexError"):
        b.forward([([101, 10**6, 102], [0, 0, 0])])
    b.close()
    with pytest.raises(LoadFailed, match="config.json"):
        ThreadBackend(LoadSpec(str(tmp_path))).load()


def test_process_backend_holds_one_job_in_flight_and_can_be_killed_in_it(tiny_checkpoint):
    b = HookedProcessBackend(LoadSpec(str(tiny_checkpoint), warmup=False))
    try:
        assert b.load()["name"] == "tiny-bert"
        b.warm_up()
        assert b.health().alive and b.pid != os.getpid() and b.in_flight() is None
        errors = []
        t = threading.Thread(target=lambda: _catch(errors, b.job, "sleep_on_model", (30,)))
        t.start()
        deadline = time.monotonic() + 10
        while b.in_flight() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        held = b.in_flight()
        assert held is not None and held.kind == "Job:sleep_on_model" and held.pid == b.pid
        stale = dataclasses.replace(held)  # equal, but not the job the process holds
        assert b.kill("timeout", stale) is False
        assert b.kill("timeout", held) is True
        t.join(10)
        assert isinstance(errors[0], ProcessDied) and errors[0].reason == "timeout" and "watchdog" in str(errors[0])
        assert errors[0].exit_code == -signal.SIGKILL
        assert b.in_flight() is None and not b.health().alive
    finally:
        b.close()


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:
        errors.append(e)
