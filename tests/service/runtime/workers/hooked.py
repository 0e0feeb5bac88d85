"""The test backend: the real process and thread backends, whose model side also runs the jobs below by
name and, where a test asks, a fault before each forward pass. The production contract knows no test hook:
a hooked backend is given another `answer` (module-level functions, so that a model process forked by the
fork server or spawned takes them by reference); everything else is the production code."""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial

from model.levels import unpack_row
from service.runtime.workers.backend import Error, Forward, Job, LoadSpec, Reply, Result
from service.runtime.workers.backend_process import ProcessBackend
from service.runtime.workers.backend_thread import ThreadBackend


def scores(outs: list) -> list:
    """Worker.run's answer with each pair's row unpacked (model.levels.unpack_row); an error stays as it is."""
    return [unpack_row(o) if isinstance(o, bytes) else o for o in outs]


def labels_of(model):
    return model.labels


def raise_value_error(model, message):
    raise ValueError(message)


def sleep_on_model(model, seconds):
    time.sleep(seconds)


POISON = 7  # a token id no text encodes to ([unused6] in the MiniLM vocabulary)


def die_on_poison(model, batch):
    """A fault: a batch holding the POISON token id kills its model process, every time."""
    if any(POISON in ids for ids, _ in batch):
        os._exit(3)


class FailNext:
    """A fault for a thread backend: once armed, the next `n` forward passes raise RuntimeError(message)."""

    def __init__(self, message: str = "injected fault"):
        self.message, self.left = message, 0

    def arm(self, n: int = 1) -> None:
        self.left = n

    def __call__(self, model, batch):
        if self.left > 0:
            self.left -= 1
            raise RuntimeError(self.message)


PADDING = 2_000_000  # zero float64s after a pair's row in `big_reply_stopped_midway`'s reply: ~16 MB pickled, so that
# the process is stopped long before the loop could read it all (4 MB sometimes crossed whole first)


def once(flag: str) -> bool:
    """True in the one model process that takes the file `flag` away: a fault that strikes once, not on the
    retry of its batch in the replacement process."""
    try:
        os.remove(flag)
    except FileNotFoundError:
        return False
    return True


def big_reply_stopped_midway(model, batch, flag: str):
    """A fault, once: the batch's scores in a reply far larger than the pipe's buffer (PADDING zero float64s
    after its rows), and the model process stops itself (SIGSTOP) as soon as that reply has begun to
    cross the pipe, half written."""
    if not once(flag):
        return None
    from service.runtime.workers import runner

    rows, seconds = runner.forward_batch(model, batch)
    threading.Thread(target=_stop_once_writing, args=(_pipe_fd(),), daemon=True).start()
    return Result((rows + bytes(8 * PADDING * len(batch)), seconds))  # a one-pair batch: its row, then zeros


def close_pipe_and_linger(model, batch, flag: str):
    """A fault, once: the model process closes its end of the pipe, then takes a second to exit (the server
    sees the end of the pipe long before the exit code)."""
    if once(flag):
        os.close(_pipe_fd())
        time.sleep(1.0)
        os._exit(3)


def _pipe_fd() -> int:
    """The model process's end of its pipe to the server: child_main's `conn`, up the stack of the fault."""
    import sys

    frame = sys._getframe()
    while frame.f_code.co_name != "child_main":
        assert frame.f_back is not None, "not called from child_main"
        frame = frame.f_back
    return frame.f_locals["conn"].fileno()


def _stop_once_writing(fd: int) -> None:
    import fcntl
    import termios
    from array import array

    queued = array("i", [0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fcntl.ioctl(fd, termios.TIOCOUTQ, queued)  # bytes written to the pipe and not read yet (SIOCOUTQ)
        if queued[0] > 0:
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        time.sleep(0.0002)


def template_state(model):
    """Whether this model process serves the fork server's template model, and its torch threads."""
    import torch

    from service.runtime.workers import template

    t = template.TEMPLATE
    used = t is not None and t.model is model
    return {"template": used, "warmed": bool(t and t.warmed), "threads": torch.get_num_threads()}


def inference_of(model):
    """What runs this model process's forward pass, and why (RelevanceModel.use_inference)."""
    return model.inference, model.inference_reason


def engine_of_process(model, hold: float = 0.5):
    """(pid, inference, reason), held long enough that two such jobs land on two model processes."""
    time.sleep(hold)
    return os.getpid(), model.inference, model.inference_reason


TEST_JOBS = {
    "labels_of": labels_of,
    "raise_value_error": raise_value_error,
    "sleep_on_model": sleep_on_model,
    "inference_of": inference_of,
    "state": template_state,
    "engine": engine_of_process,
}


def answer(model, spec: LoadSpec, message: Forward | Job, fault=None) -> Reply:
    """runner.handle, after `fault(model, batch)` before a forward (its reply instead, if it returns one),
    with TEST_JOBS beside runner.JOBS."""
    from service.runtime.workers import runner  # torch: in the model process

    try:
        if isinstance(message, Forward) and fault is not None and (reply := fault(model, message.batch)) is not None:
            return reply
        if isinstance(message, Job) and message.name in TEST_JOBS:
            return Result(TEST_JOBS[message.name](model, *message.args, **message.kwargs))
    except Exception as e:
        return Error(type(e).__name__, str(e))
    return runner.handle(model, spec, message)


class HookedProcessBackend(ProcessBackend):
    def __init__(self, spec: LoadSpec, name: str = "qtrel-model", fault=None):
        super().__init__(spec, name, answer=partial(answer, fault=fault))


class HookedThreadBackend(ThreadBackend):
    def __init__(self, spec: LoadSpec, name: str = "qtrel-model", fault=None):
        super().__init__(spec, name, answer=partial(answer, fault=fault))


def hooked(mode: str = "process", fault=None):
    """A Worker's `backend`: the hooked backend of `mode`, with `fault` before each forward."""
    kind = HookedProcessBackend if mode == "process" else HookedThreadBackend
    return partial(kind, fault=fault)


def serve_hooked(monkeypatch, mode: str = "process", fault=None) -> None:
    """Every Worker a server builds from here on (service.runtime.models) runs the hooked backend of `mode`."""
    from service.runtime import models

    monkeypatch.setattr(models, "Worker", partial(models.Worker, backend=hooked(mode, fault)))
