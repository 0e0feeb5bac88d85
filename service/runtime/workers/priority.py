"""The OS priority of the process that runs a score job (service.runtime.workers.driver): Linux's idle class
(SCHED_IDLE: such a process runs only on a CPU that nothing else wants, and a woken process of the normal class
preempts it at once), else nice 19. Lowered once, at the process's start; an unprivileged process cannot raise
it back (that needs CAP_SYS_NICE, which containers drop), so it stays so for the process's life."""

from __future__ import annotations

import os

SCHED_IDLE = "sched_idle"
NICE = "nice"


def lower_priority(prefer_idle: bool = True) -> str:
    """Lower every thread of this process (threads started later inherit it): SCHED_IDLE where the OS has it
    (`prefer_idle`), else nice 19. Which one: SCHED_IDLE or NICE."""
    if prefer_idle and hasattr(os, "SCHED_IDLE"):
        try:
            for tid in _threads():
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return SCHED_IDLE
        except OSError:  # a kernel or a seccomp profile that refuses it
            pass
    os.nice(19 - os.nice(0))  # the calling thread on Linux (the process elsewhere): call it before threads start
    return NICE


def policy_of(pid: int) -> str:
    """SCHED_IDLE, NICE (nice 19 in the normal class) or "normal": what a process runs at."""
    if hasattr(os, "sched_getscheduler") and os.sched_getscheduler(pid) == os.SCHED_IDLE:
        return SCHED_IDLE
    return NICE if os.getpriority(os.PRIO_PROCESS, pid) >= 19 else "normal"


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # the calling thread
