"""Named jobs for the worker tests: a spec lists them as ("name", "tests.service.runtime.workers.jobs:function"),
so that a model process imports them by name (a job never travels as a pickled callable)."""

from __future__ import annotations

import os
import time

TEST_JOBS = (
    ("labels_of", "tests.service.runtime.workers.jobs:labels_of"),
    ("raise_value_error", "tests.service.runtime.workers.jobs:raise_value_error"),
    ("sleep_on_model", "tests.service.runtime.workers.jobs:sleep_on_model"),
    ("inference_of", "tests.service.runtime.workers.jobs:inference_of"),
)


def labels_of(model):
    return model.labels


def raise_value_error(model, message):
    raise ValueError(message)


def sleep_on_model(model, seconds):
    time.sleep(seconds)


POISON = 7  # a token id no text encodes to ([unused6] in the MiniLM vocabulary)


def die_on_poison(model, batch):
    """Fault hook: a batch holding the POISON token id kills its model process, every time."""
    if any(POISON in ids for ids, _ in batch):
        os._exit(3)


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
    import os
    import time

    time.sleep(hold)
    return os.getpid(), model.inference, model.inference_reason
