"""The backend contract: what the worker asks of one model instance, the messages that carry it over a
pipe, the errors it can raise, and the one state machine of a model instance and of the worker.

A backend is one model instance driven by one thread of the server (its replica's), as TEI's backend
trait: `load`, `warm_up`, `forward` a batch, run a named extra `job` (e.g. "explain"), report `health`.
Two implementations keep that contract: `service.runtime.workers.backend_thread` (the model on the calling
thread) and `service.runtime.workers.backend_process` (the model in a child process, typed messages over a
pipe). Extra jobs are names looked up on the model's side (`service.runtime.workers.runner.JOBS`), never
pickled callables.

The errors say what failed: `ModelError` is an exception the model raised for this job (the process
lives on), `ProcessDied` means the model process went away while it held the job (it died, or the
watchdog killed it) -- a batch that fails so may be retried on another process. `NotReady` refuses a job
when no model can take it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from model.levels import MAX_BATCH_TOKENS

if TYPE_CHECKING:  # the model lives in the model processes
    from model.relevance import RelevanceModel

# (input_ids, token_type_ids) of one pair: lists, or bytes as a front process packs them (model.tokenizer.pack_pair:
# the engine core passes them on as they came; the model process unpacks them)
Encoded = tuple[list[int], list[int]] | tuple[bytes, bytes]
# A forwarded batch: its rows, joined, in batch order (model.levels.ScoredBatch.pack: one `bytes` to unpickle,
# where numpy columns cost the event loop a reconstruction each), and the forward pass's seconds
Forwarded = tuple[bytes, float]
Done = Callable[[Any, BaseException | None], None]  # (value, error) of an exchange the event loop drove

# Where the server hands the fork server the LoadSpec to load as its template (JSON): set by backend_process,
# read by template, which the server never imports
TEMPLATE_ENV = "QTREL_MODEL_TEMPLATE"


@dataclass(frozen=True)
class LoadSpec:
    """What to load and how: picklable, so that a child process can load it."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    max_length: int = 128
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    warmup: bool = True
    max_batch_tokens: int = MAX_BATCH_TOKENS  # the largest batch warm-up prepares for
    start: str = "template"  # process backend on cpu: "template" (forked by the fork server) or "spawn"
    # What runs the forward: "torch", "openvino" or "auto" (probed); chosen in the model process after the fork.
    inference: str = "torch"
    # The torch forward's attention kernel on cpu: "auto" (probed), "fused" or "torch" (model.engines.kernels).
    attention: str = "auto"


class _Message:
    """Pickles as its class and field values: a third of the default's cost on the per-batch path."""

    def __reduce__(self):
        return type(self), tuple(self.__dict__.values())


# --- messages: server -> model ------------------------------------------------------------------
@dataclass(frozen=True)
class WarmUp(_Message):
    """Warm the loaded model up (if the spec says so); answered by Ready or Failed."""


@dataclass(frozen=True)
class Forward(_Message):
    """Score one batch; answered by Result(Forwarded) or Error."""

    batch: Sequence[Encoded]


@dataclass(frozen=True)
class Job(_Message):
    """Run the named job of the registry on the model; answered by Result(value) or Error."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stop(_Message):
    """Exit the model process."""


# --- messages: model -> server ------------------------------------------------------------------
@dataclass(frozen=True)
class Loaded(_Message):
    info: dict  # RelevanceModel.describe()


@dataclass(frozen=True)
class Ready(_Message):
    pass


@dataclass(frozen=True)
class Failed(_Message):
    reason: str  # loading or warming up failed: "<type>: <message>"


@dataclass(frozen=True)
class Result(_Message):
    value: Any


@dataclass(frozen=True)
class Error(_Message):
    type: str
    message: str


Request = WarmUp | Forward | Job | Stop
Reply = Loaded | Ready | Failed | Result | Error
# The model's side of a Forward or Job (service.runtime.workers.runner.handle, unless a backend is given
# another): a module-level function, so that it reaches a model process by reference.
Answer = Callable[["RelevanceModel", LoadSpec, Forward | Job], Reply]


@dataclass(frozen=True)
class InFlight:
    """A job a model process holds: what, since when (monotonic seconds), on which process."""

    kind: str  # "Forward" or "Job:<name>"
    since: float
    pid: int


@dataclass(frozen=True)
class Health:
    alive: bool
    detail: str = ""


# --- errors -------------------------------------------------------------------------------------
class BackendError(RuntimeError):
    """Base of the errors a backend raises."""


class NotReady(BackendError):
    """No model can take work now: loading, warming up, draining, stopped, or failed (`why`)."""

    def __init__(self, why: str):
        super().__init__(f"not ready: {why}")
        self.why = why


class LoadFailed(BackendError):
    """Loading or warming up the model failed; the reason is in the message. `crashed`: the model process
    exited (killed, out of memory) rather than the model refusing to load: worth another try."""

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed


class ModelError(BackendError):
    """An exception the model raised for one job, re-raised here by type name and message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class ProcessDied(BackendError):
    """The model process went away while it held a job: `reason` "died" (it exited) or "timeout" (the
    watchdog killed it). A batch failed so is retried once on a live process."""

    def __init__(self, reason: str, exit_code: int | None):
        how = "was killed by the watchdog" if reason == "timeout" else "died"
        super().__init__(f"the model process {how} during this job (exit code {exit_code})")
        self.reason = reason
        self.exit_code = exit_code


def raise_for(reply: Reply) -> Any:
    """The value of a Result; an Error raised as ModelError."""
    if isinstance(reply, Error):
        raise ModelError(reply.type, reply.message)
    if not isinstance(reply, Result):
        raise BackendError(f"unexpected reply {type(reply).__name__}")
    return reply.value


# --- the interface ------------------------------------------------------------------------------
class Backend(ABC):
    """One model instance. All calls come from one thread (its replica's), one at a time."""

    @abstractmethod
    def load(self) -> dict:
        """Load the model; its `describe()`. Raises LoadFailed."""

    @abstractmethod
    def warm_up(self) -> None:
        """Warm the loaded model up (a no-op if the spec says no warm-up). Raises LoadFailed."""

    @abstractmethod
    def forward(self, batch: Sequence[Encoded]) -> Forwarded:
        """Score one batch: its rows packed, in batch order, and the forward's seconds. Raises ModelError, or
        ProcessDied."""

    @abstractmethod
    def job(self, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run a named extra job on the model. Raises ModelError, or ProcessDied."""

    @abstractmethod
    def health(self) -> Health: ...

    @property
    def pid(self) -> int | None:
        """The model process, if the model lives in one."""
        return None

    def in_flight(self) -> InFlight | None:
        """The job a model process holds now (for the watchdog); None on a backend that cannot be killed."""
        return None

    # A backend whose exchange the event loop can drive itself (`start_on_loop`), without its replica's thread.
    loop_driven = False

    def start_on_loop(self, loop: Any, message: Forward | Job, done: Done) -> None:
        """Send `message` and return at once; `done(value, error)` is called on `loop` once the reply is read.
        Never blocks the loop, whatever the model process does."""
        raise NotImplementedError

    def kill(self, reason: str, expected: InFlight) -> bool:
        """Kill the model process if it still holds `expected`; the job then fails with ProcessDied."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the model (stop its process)."""


# --- the state machine --------------------------------------------------------------------------
class State(str, Enum):
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    RESTARTING = "restarting"  # a model process died; a new one is being started (with backoff)
    FAILED = "failed"  # the model cannot be loaded at start: the server exits
    STOPPING = "stopping"
    STOPPED = "stopped"


_ENDING = {State.STOPPING, State.STOPPED}
# The one table of allowed transitions, for a replica and for the worker (whose state summarises them).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.LOADING: frozenset({State.WARMING, State.READY, State.RESTARTING, State.FAILED, *_ENDING}),
    State.WARMING: frozenset({State.READY, State.RESTARTING, State.FAILED, *_ENDING}),
    State.READY: frozenset({State.RESTARTING, State.FAILED, *_ENDING}),
    State.RESTARTING: frozenset({State.READY, State.FAILED, *_ENDING}),
    State.FAILED: frozenset(_ENDING),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class StateMachine:
    """A state that changes only along TRANSITIONS, safe to read and change from any thread.

    Stopping wins every race: a transition asked for once stopping began is refused quietly (False),
    any other transition outside the table raises IllegalTransition (a bug)."""

    def __init__(self, on_change: Callable[[State, State], None] | None = None):
        self._state = State.LOADING
        self._cond = threading.Condition()
        self._on_change = on_change

    @property
    def state(self) -> State:
        return self._state

    def advance(self, to: State) -> bool:
        with self._cond:
            old = self._state
            if to == old:
                return False
            if to not in TRANSITIONS[old]:
                if old in _ENDING:
                    return False
                raise IllegalTransition(f"{old.value} -> {to.value}")
            self._state = to
            self._cond.notify_all()
        if self._on_change:
            self._on_change(old, to)
        return True

    def wait_for(self, states: Collection[State], timeout: float | None = None) -> State:
        """Block until the state is one of `states` (or `timeout` passed); the state then."""
        with self._cond:
            self._cond.wait_for(lambda: self._state in states, timeout)
            return self._state

    @property
    def ending(self) -> bool:
        return self._state in _ENDING
