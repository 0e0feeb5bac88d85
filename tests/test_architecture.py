"""The architecture as a test: which part may import what, and how long a source file may grow.

Every .py under model/ and service/ (and the model tests) is parsed with `ast`; no code is imported.
A rule names the files it covers (path patterns), the modules they must not import (module patterns:
`fastapi` also covers `fastapi.responses`, `service.worker*` also covers `service.workers.thread`) and
why. Imports inside functions and under `if TYPE_CHECKING:` count like any other.

A violation that exists today and is being fixed goes into KNOWN with its reason, so that this test
passes now, fails on any new violation, and says (as a warning) which KNOWN entries no longer occur
and can be deleted.
"""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("model", "service", "tests/model")  # folders whose .py files are checked
SIZED = ("model", "service")  # folders whose .py files must stay under MAX_LINES
MAX_LINES = 400  # "a file that grows past ~400 lines usually owns two things" (STYLE.md)

WEB = ("fastapi", "starlette", "uvicorn")
HTTP = ("service/routes*", "service/deps.py", "service/explain.py", "service/http*")  # route handlers
RUNTIME = ("service/engine*", "service/worker*", "service/replica*", "service/backend*", "service/runner*",
           "service/runtime*")  # fmt: skip
RUNTIME_MODULES = tuple(p.replace("/", ".") for p in RUNTIME)  # below HTTP, above the model
# What a handler may use of the project: its dependencies (service.deps), the engine's public types, the
# schemas, errors, settings and metrics, and the model's scored-batch contract.
HTTP_MAY_IMPORT = ("service.deps", "service.engine", "service.schemas", "service.errors", "service.settings",
                   "service.metrics", "service.logs", "service.routes", "model.scoring")  # fmt: skip
MODEL_INTERNALS = ("model.bert*", "model.kernels*", "model.packing*")  # behind RelevanceModel


@dataclass(frozen=True)
class Rule:
    name: str
    files: tuple[str, ...]  # path patterns, relative to the repository root
    forbid: tuple[str, ...]  # module patterns
    why: str
    allow: tuple[str, ...] = ()  # exceptions to `forbid`


# fmt: off
RULES = (
    Rule("model-knows-no-service", ("model/*",),
         ("service", *WEB, "pydantic_settings", "prometheus_client"),
         "the model knows nothing of the service or of HTTP"),
    Rule("batcher-knows-no-model", ("service/batcher*",),
         ("model", "torch", "tokenizers", *WEB, "pydantic", *RUNTIME_MODULES, "opentelemetry", "service.tracing"),
         "the batcher batches items with a token length: no BERT, no worker, no FastAPI, no tracing library "
         "(it reports batch timings to a BatchTracer hook)"),
    Rule("runtime-knows-no-http", RUNTIME,
         (*WEB, "service.routes*", "service.deps", "service.explain", "service.http*", "service.app",
          "opentelemetry"),
         "the engine, worker and backends sit below HTTP; spans go through service.tracing, which imports "
         "OpenTelemetry only when tracing is on"),
    Rule("runtime-uses-the-model-contract", RUNTIME, MODEL_INTERNALS,
         "the worker and engine use RelevanceModel's contract, not the architecture, packing or kernels"),
    Rule("http-goes-through-the-engine", HTTP, ("service", "model", "torch"),
         "route handlers validate, submit to the engine (via service.deps) and shape the response",
         allow=HTTP_MAY_IMPORT),
    Rule("model-tests-need-no-service", ("tests/model/*",), ("service",),
         "tests mirror the packages: a model test runs without the service"),
)
# fmt: on

# HTTP handlers must not reach through the engine to these attributes (`engine.worker.pids`).
HTTP_FORBIDDEN_ATTRIBUTES = ("worker", "batcher", "backend")

# Violations in the committed tree when this test was written, each being removed by the restructuring
# of issue 11 (some already are in the working tree). Key: (rule, file, what), where `what` is the imported
# module, the private name, the attribute, or "lines" for the size rule. Delete an entry as soon as the
# warning says it no longer occurs; never add one without a reason and an issue that removes it.
# fmt: off
KNOWN: dict[tuple[str, str, str], str] = {
}
# fmt: on


@dataclass(frozen=True)
class Violation:
    rule: str
    file: str
    what: str
    line: int
    why: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.file, self.what)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.what} — {self.why}"


def matches(module: str, pattern: str) -> bool:
    return fnmatch(module, pattern) or fnmatch(module, pattern + ".*")


def module_of(rel: str) -> str:
    """model/scoring.py -> model.scoring; service/__init__.py -> service."""
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(tree: ast.AST, rel: str, root: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import; `from pkg import sub` yields pkg.sub."""
    here = module_of(rel)
    package = here if rel.endswith("__init__.py") else here.rpartition(".")[0]
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(p for p in (*up, base) if p)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if is_module(sub, root):
                    out.append((sub, None, node.lineno))
                else:
                    out.append((base, a.name, node.lineno))
    return out


def check_source(rel: str, source: str, root: Path = ROOT) -> list[Violation]:
    """Every rule's violations in one file, given as its path relative to the root and its text."""
    tree = ast.parse(source, filename=rel)
    found: list[Violation] = []

    def add(rule: str, what: str, line: int, why: str) -> None:
        found.append(Violation(rule, rel, what, line, why))

    for module, name, line in imports(tree, rel, root):
        for rule in RULES:
            if not any(fnmatch(rel, p) for p in rule.files):
                continue
            if any(matches(module, p) for p in rule.forbid) and not any(matches(module, p) for p in rule.allow):
                add(rule.name, module, line, rule.why)
        private = name is not None and name.startswith("_") and not name.startswith("__")
        if private and module.split(".")[0] in ("model", "service"):
            add("private-import", f"{module}.{name}", line, "a leading underscore means private to its module")
    if any(fnmatch(rel, p) for p in HTTP):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in HTTP_FORBIDDEN_ATTRIBUTES:
                add("http-reaches-engine-internals", node.attr, node.lineno, "handlers ask the engine, not its parts")
    n = len(source.splitlines())
    if any(rel.startswith(d + "/") for d in SIZED) and n > MAX_LINES:
        add("file-size", "lines", n, f"{n} lines, over {MAX_LINES}: a file this long usually owns two things")
    return found


def scan(root: Path = ROOT) -> list[Violation]:
    found: list[Violation] = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            found.extend(check_source(rel, path.read_text(encoding="utf-8"), root))
    return found


def test_no_new_architecture_violations():
    found = scan()
    new = [v for v in found if v.key not in KNOWN]
    gone = sorted(set(KNOWN) - {v.key for v in found})
    if gone:
        msg = "KNOWN entries that no longer occur; delete them from tests/test_architecture.py:\n" + "\n".join(
            f"  {k}" for k in gone
        )
        print(msg)
        warnings.warn(msg, stacklevel=1)
    shown = sorted({str(v) for v in new})
    assert not new, "architecture violations (fix them; if deliberate and temporary, add to KNOWN with a reason):\n" + (
        "\n".join(f"  {v}" for v in shown)
    )


def test_every_rule_names_a_reason_and_known_names_a_rule():
    names = {r.name for r in RULES} | {"private-import", "http-reaches-engine-internals", "file-size"}
    assert len({r.name for r in RULES}) == len(RULES)
    for rule, _, _ in KNOWN:
        assert rule in names, rule
    assert all(reason.strip() for reason in KNOWN.values())


# --- the checker itself: each rule catches a forbidden import written as a string -----------------
def keys(rel: str, source: str) -> set[tuple[str, str, str]]:
    return {v.key for v in check_source(rel, source)}


def test_model_importing_the_service_is_caught():
    assert keys("model/x.py", "from service.routes import router\n") == {
        ("model-knows-no-service", "model/x.py", "service.routes")
    }
    assert keys("model/x.py", "def f():\n    import fastapi.responses\n") == {
        ("model-knows-no-service", "model/x.py", "fastapi.responses")
    }
    assert keys("model/x.py", "from service import worker\n") == {
        ("model-knows-no-service", "model/x.py", "service.worker")
    }
    assert keys("model/x.py", "from model.bert import BertForRelevance\nimport torch\n") == set()


def test_batcher_importing_the_model_or_fastapi_is_caught():
    found = keys("service/batcher.py", "import torch\nfrom fastapi import Request\nfrom model.tokenizer import X\n")
    assert {what for _, _, what in found} == {"torch", "fastapi", "model.tokenizer"}
    assert keys("service/batcher.py", "import asyncio\nfrom collections import deque\n") == set()
    traced = keys("service/batcher.py", "from opentelemetry import trace\nfrom service.tracing import Tracing\n")
    assert {what for _, _, what in traced} == {"opentelemetry", "service.tracing"}


def test_http_reaching_into_the_worker_is_caught():
    src = (
        "from service.worker import WorkerState\n"
        "from service.engine import Engine, _version\n"
        "from model.scoring import ScoredBatch\n"
        "from model.bert import BertForRelevance\n"
        "def live(engine):\n    return engine.worker.alive()\n"
    )
    assert keys("service/routes.py", src) == {
        ("http-goes-through-the-engine", "service/routes.py", "service.worker"),
        ("private-import", "service/routes.py", "service.engine._version"),
        ("http-goes-through-the-engine", "service/routes.py", "model.bert"),
        ("http-reaches-engine-internals", "service/routes.py", "worker"),
    }
    assert keys("service/deps.py", "from service.engine import Engine\nfrom service.errors import ErrorKind\n") == set()


def test_runtime_importing_http_or_model_internals_is_caught():
    found = keys("service/worker.py", "from fastapi import FastAPI\nfrom model.kernels import probe\n")
    assert found == {
        ("runtime-knows-no-http", "service/worker.py", "fastapi"),
        ("runtime-uses-the-model-contract", "service/worker.py", "model.kernels"),
    }
    relative = keys("service/backends/process.py", "from ..routes import router\n")
    assert relative == {("runtime-knows-no-http", "service/backends/process.py", "service.routes")}


def test_an_oversized_file_is_caught():
    assert keys("service/x.py", "x = 1\n" * (MAX_LINES + 1)) == {("file-size", "service/x.py", "lines")}
    assert keys("service/x.py", "x = 1\n" * MAX_LINES) == set()
