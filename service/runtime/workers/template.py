"""The template the model processes are forked from: torch, and one model loaded and warmed up, once.

On Linux the model processes are started by multiprocessing's fork server (`service.runtime.workers.backend_process`),
which imports this module before it forks anything. The fork server is a single-threaded process (torch on
one thread, no OpenMP team, no OpenBLAS threads), so the reason spawn was used -- never fork a process that
already runs threads -- does not apply to it. What it holds when it forks, every model process shares
copy-on-write instead of building its own: libtorch's start-up heap, the bfloat16 weights with their oneDNN
packed copies, and the oneDNN kernels of the whole warm-up ladder (~170 MB of each model process;
docs/benchmarks.md, "Memory of `qtrel serve`").

Which model: the LoadSpec the server puts in `QTREL_MODEL_TEMPLATE` when it starts the fork server
(`backend_process.start_context`); the server itself never imports this module. A model process uses the
template only for that very spec and while the weights file is the one that was loaded (`take`); any other
model (a second model, a reload from another checkpoint, a cuda device) is loaded by its process as before.
The template is warmed only where the model processes run one torch thread, as the template does (oneDNN's
kernels are built for a thread count). It is this module's one attribute, `TEMPLATE`, set at import: a fork
server's preloading is importing modules.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.runtime.workers.backend import TEMPLATE_ENV, LoadSpec

if TYPE_CHECKING:  # torch is imported by build(), after OPENBLAS_NUM_THREADS is set
    from model.relevance import RelevanceModel

log = logging.getLogger("qtrel.worker")


@dataclass(frozen=True)
class Template:
    spec: LoadSpec
    stamp: tuple[int, ...]  # the weights file's identity when it was loaded (weights_stamp)
    model: RelevanceModel
    warmed: bool  # the warm-up ladder ran here, on one torch thread
    default_threads: int  # torch's own thread count, for a spec that asks for it (threads=0)


def decode(text: str) -> LoadSpec:
    return LoadSpec(**json.loads(text))


def weights_stamp(model_dir: str) -> tuple[int, ...]:
    """(device, inode, size, mtime) of every weights file: a checkpoint rewritten in place differs."""
    out: list[int] = []
    for name in ("model.safetensors", "pytorch_model.bin", "config.json"):
        try:
            st = (Path(model_dir) / name).stat()
        except OSError:
            continue
        out += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return tuple(out)


def build(spec: LoadSpec) -> Template | None:
    """Load (and, for one-thread model processes, warm up) `spec`'s model here; None where that fails (each
    model process then loads its own and reports the failure as usual)."""
    try:
        import torch

        from service.runtime.layout import quiet_gc, release_free_memory
        from service.runtime.workers import runner

        default_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # never an OpenMP team in a process that forks
        stamp = weights_stamp(spec.model_dir)
        model = runner.load_model(dataclasses.replace(spec, threads=1))
        warmed = spec.warmup and spec.threads == 1
        if warmed:
            runner.warm_up(model, spec)
        quiet_gc()
        release_free_memory()
        return Template(spec, stamp, model, warmed, default_threads)
    except Exception as e:  # the fork server must live on: every model process needs it
        log.warning("no model template (each model process loads its own): %s: %s", type(e).__name__, e)
        return None


def take(spec: LoadSpec) -> Template | None:
    """The template, if it is `spec`'s model as it is on disk now (whatever the inference choice: that is
    made after the fork, and a restart pins `auto` to the first process's choice)."""
    t = TEMPLATE
    if (
        t is None
        or dataclasses.replace(t.spec, inference=spec.inference) != spec
        or t.stamp != weights_stamp(spec.model_dir)
    ):
        return None
    return t


def _from_environment() -> Template | None:
    text = os.environ.pop(TEMPLATE_ENV, None)  # popped: the processes forked from here never build one again
    if not text:
        return None
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: no BLAS thread pool in the fork server
    return build(decode(text))


TEMPLATE: Template | None = _from_environment()
