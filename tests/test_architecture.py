"""The architecture as a test: which part may reach what, held on each module's import closure, and how
long a source file may grow.

Every .py under model/, service/ and tests/ is parsed with `ast`; no code is imported. A module's closure
is every module it imports, directly or through others (imports inside functions and under
`if TYPE_CHECKING:` count, and importing `a.b.c` runs `a` and `a.b` too). A rule names the files it
covers, the modules their closure must not reach (`fastapi` also covers `fastapi.responses`) and why. A
rule may name gateways: modules the closure does not pass through (HTTP reaches the runtime through the
engine, whose own closure is the runtime's business).

A violation that exists today and is being fixed goes into KNOWN with its reason, so that this test
passes now, fails on any new violation, and says which KNOWN entries no longer occur.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("model", "service", "tests", "bench")  # folders whose .py files make up the graph
SIZED = ("model", "service", "bench")  # folders whose .py files must stay under MAX_LINES
MAX_LINES = 400  # "a file that grows past ~400 lines usually owns two things" (STYLE.md)

WEB = ("fastapi", "starlette", "uvicorn")
MODEL_INTERNALS = ("model.bert", "model.engines", "model.packing")  # behind RelevanceModel


def core(rel: str) -> bool:
    """The model core: model/ and its engines, not its wings."""
    return rel.startswith("model/") and not rel.startswith(("model/train/", "model/bulk/"))


# The batcher's modules: the queue (batcher.py), its vocabulary (batching.py), its admission (admission.py), the
# model's measured pace (pace.py).
BATCHER = (
    "service/runtime/batcher.py",
    "service/runtime/batching.py",
    "service/runtime/admission.py",
    "service/runtime/pace.py",
)


def under(folder: str) -> Callable[[str], bool]:
    return lambda rel: rel.startswith(folder + "/")


@dataclass(frozen=True)
class Rule:
    name: str
    files: Callable[[str], bool]  # which files (paths relative to the root) it covers
    forbid: tuple[str, ...]  # module prefixes the closure must not reach
    why: str
    gateways: tuple[str, ...] = ()  # modules the closure does not pass through
    direct: bool = False  # checked on the file's own imports only


# fmt: off
RULES = (
    Rule("model-core-knows-no-wing", core,
         ("model.train", "model.bulk", "service", *WEB, "pydantic_settings", "prometheus_client"),
         "the model core knows nothing of its wings, of the service or of HTTP"),
    Rule("train-wing-stands-apart", under("model/train"), ("model.bulk", "service", *WEB),
         "training and evaluation need neither bulk scoring nor the service"),
    Rule("bulk-wing-stands-apart", under("model/bulk"), ("model.train", "service", *WEB),
         "bulk scoring needs neither training nor the service"),
    Rule("runtime-knows-no-http", under("service/runtime"),
         ("service.http", "service.app", "service.cli", *WEB, "opentelemetry"),
         "the engine, batcher, worker and backends sit below HTTP, even one hop away; spans go through "
         "service.tracing, which imports OpenTelemetry only when tracing is on",
         gateways=("service.tracing",)),
    Rule("workers-know-no-engine", under("service/runtime/workers"), ("service",),
         "the model processes load, warm up and forward what they are handed: no engine, queue, cache, settings "
         "or jobs; of the rest of the service they use only the layout's memory helpers",
         gateways=("service.runtime.workers", "service.runtime.layout")),
    Rule("runtime-uses-the-model-contract", under("service/runtime"), MODEL_INTERNALS,
         "the runtime uses RelevanceModel's contract, not the architecture, packing or kernels", direct=True),
    Rule("batcher-knows-no-model", lambda rel: rel in BATCHER,
         ("model", "torch", "tokenizers", *WEB, "pydantic", "service", "opentelemetry"),
         "the batcher batches items with a token length: no BERT, no worker, no FastAPI, no tracing library "
         "(it reports batch timings to a BatchTracer hook); it reaches only its own modules",
         gateways=tuple(rel.removesuffix(".py").replace("/", ".") for rel in BATCHER)),
    Rule("http-goes-through-the-engine", under("service/http"),
         ("service.runtime", "model", "torch", "tokenizers", "safetensors"),
         "route handlers validate, submit to the engine and shape the response: they reach the runtime and "
         "the model only through the engine (and the torch-free model.levels)",
         gateways=("service.runtime.engine", "model.levels")),
    Rule("model-tests-need-no-service", under("tests/model"), ("service",),
         "tests mirror the packages: a model test runs without the service"),
)
# fmt: on

# HTTP handlers must not reach through the engine to these attributes (`engine.worker.pids`).
HTTP_FORBIDDEN_ATTRIBUTES = ("worker", "batcher", "backend")

# Key: (rule, file, what), where `what` is the module reached, the private name, the attribute, or "lines"
# for the size rule. Delete an entry as soon as it no longer occurs; never add one without a reason.
KNOWN: dict[tuple[str, str, str], str] = {}


@dataclass(frozen=True)
class Violation:
    rule: str
    file: str
    what: str
    line: int
    why: str
    path: tuple[str, ...] = ()  # how the closure reached `what`

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.file, self.what)

    def __str__(self) -> str:
        via = f" (via {' -> '.join(self.path)})" if len(self.path) > 1 else ""
        return f"{self.file}:{self.line}: [{self.rule}] {self.what}{via} — {self.why}"


def matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def module_of(rel: str) -> str:
    """model/scoring.py -> model.scoring; service/__init__.py -> service."""
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class Graph:
    """The project's modules and their imports, from the files on disk and any given as text."""

    def __init__(self, root: Path = ROOT, extra: dict[str, str] | None = None):
        self.sources: dict[str, str] = {}
        for folder in SCANNED:
            for path in sorted((root / folder).rglob("*.py")):
                self.sources[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
        self.sources.update(extra or {})
        self.files = {module_of(rel): rel for rel in self.sources}
        self._imports: dict[str, list[tuple[str, str | None, int]]] = {}

    def imports(self, rel: str) -> list[tuple[str, str | None, int]]:
        """(module, imported name or None, line) for every import; `from pkg import sub` yields pkg.sub."""
        if rel not in self._imports:
            here = module_of(rel)
            package = here if rel.endswith("__init__.py") else here.rpartition(".")[0]
            out: list[tuple[str, str | None, int]] = []
            for node in ast.walk(ast.parse(self.sources[rel], filename=rel)):
                if isinstance(node, ast.Import):
                    out.extend((a.name, None, node.lineno) for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:  # relative: resolve against this file's package
                        up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                        base = ".".join(p for p in (*up, base) if p)
                    for a in node.names:
                        sub = f"{base}.{a.name}"
                        out.append((sub, None, node.lineno) if sub in self.files else (base, a.name, node.lineno))
            self._imports[rel] = out
        return self._imports[rel]

    def closure(self, rel: str, gateways: tuple[str, ...] = ()) -> dict[str, tuple[tuple[str, ...], int]]:
        """Every module reached from `rel`: module -> (the chain of modules that reached it, the line of
        `rel` where that chain starts). Third-party modules are leaves; gateways are reached, not passed."""
        start = module_of(rel)
        seen: dict[str, tuple[tuple[str, ...], int]] = {}
        todo: list[tuple[str, tuple[str, ...], int]] = [(start, (start,), 0)]
        while todo:
            mod, chain, line = todo.pop()
            src = self.files.get(mod)
            if src is None or (mod != start and any(matches(mod, g) for g in gateways)):
                continue
            for target, _, at in self.imports(src):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b too
                    reached = ".".join(parts[:i])
                    if reached not in seen and reached != start:
                        seen[reached] = ((*chain, reached), line or at)
                        todo.append((reached, (*chain, reached), line or at))
        return seen


def check(graph: Graph, rel: str) -> list[Violation]:
    """Every rule's violations in one file of the graph."""
    found: list[Violation] = []
    for rule in RULES:
        if not rule.files(rel):
            continue
        if rule.direct:
            reached = {m: ((module_of(rel), m), line) for m, _, line in graph.imports(rel)}
        else:
            reached = graph.closure(rel, rule.gateways)
        for module, (chain, line) in sorted(reached.items()):
            passage = any(matches(module, g) or matches(g, module) for g in rule.gateways)  # a gateway or its package
            if any(matches(module, f) for f in rule.forbid) and not passage:
                found.append(Violation(rule.name, rel, module, line, rule.why, chain))
    for module, name, line in graph.imports(rel):
        private = name is not None and name.startswith("_") and not name.startswith("__")
        if private and module.split(".")[0] in ("model", "service"):
            found.append(Violation("private-import", rel, f"{module}.{name}", line, "private to its module"))
    if rel.startswith("service/http/"):
        for node in ast.walk(ast.parse(graph.sources[rel])):
            if isinstance(node, ast.Attribute) and node.attr in HTTP_FORBIDDEN_ATTRIBUTES:
                found.append(
                    Violation(
                        "http-reaches-engine-internals", rel, node.attr, node.lineno, "ask the engine, not its parts"
                    )
                )
    for module, _, line in graph.imports(rel):
        if matches(module, "lab"):
            found.append(Violation("imports-lab", rel, module, line, "lab/ holds finished studies: never imported"))
    if rel.startswith("bench/"):
        found += bench_habits(graph, rel)
    n = len(graph.sources[rel].splitlines())
    if any(rel.startswith(d + "/") for d in SIZED) and n > MAX_LINES:
        found.append(Violation("file-size", rel, "lines", n, f"{n} lines, over {MAX_LINES}: it owns two things"))
    return found


def bench_habits(graph: Graph, rel: str) -> list[Violation]:
    """A maintained benchmark finds bench/harness as a package beside it (no sys.path edits, no imports below
    code), and uses only public names of the model and the service: no private module, no private attribute."""
    found = []
    src = graph.sources[rel]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "sys" and node.attr == "path":
                found.append(Violation("bench-sys-path", rel, "sys.path", node.lineno, "harness is a package"))
            elif node.attr.startswith("_") and not node.attr.startswith("__") and node.value.id not in ("self", "cls"):
                why = "a private name: add a public accessor"
                found.append(Violation("bench-private-name", rel, f"{node.value.id}.{node.attr}", node.lineno, why))
    for module, _, line in graph.imports(rel):
        if module.split(".")[0] in ("model", "service") and any(p.startswith("_") for p in module.split(".")[1:]):
            found.append(Violation("bench-private-name", rel, module, line, "a private module"))
    for i, text in enumerate(src.splitlines(), 1):
        if "noqa: E402" in text:
            found.append(Violation("bench-import-below-code", rel, "E402", i, "imports go at the top"))
    return found


CYCLE_WHY = "an import circle: each name belongs in one of them, or in a module both import"


def import_cycles(graph: Graph) -> list[Violation]:
    """One violation per import circle among the product's modules (model/ and service/): a set of modules that
    each reach the others through their own imports (in functions and under TYPE_CHECKING too). Only the
    module named counts, not the packages above it: a package's lazy `__getattr__` is no circle."""
    product = {mod: rel for mod, rel in graph.files.items() if rel.split("/")[0] in SIZED}
    edges = {mod: {t for t, _, _ in graph.imports(rel) if t in product and t != mod} for mod, rel in product.items()}

    reached: dict[str, dict[str, str]] = {}  # per module: each module it reaches -> the one it came from
    for mod in product:
        seen: dict[str, str] = {}
        todo = [mod]
        while todo:
            cur = todo.pop()
            for nxt in sorted(edges[cur]):
                if nxt not in seen:
                    seen[nxt] = cur
                    todo.append(nxt)
        reached[mod] = seen
    found: list[Violation] = []
    done: set[str] = set()
    for mod in sorted(product):
        if mod in done or mod not in reached[mod]:
            continue
        circle = {m for m in reached[mod] if mod in reached[m]}
        done |= circle
        path, cur = [mod], reached[mod][mod]  # walk back from mod to itself along first-reached links
        while cur != mod:
            path.append(cur)
            cur = reached[mod][cur]
        path = [mod, *reversed(path[1:]), mod]
        line = next(at for t, _, at in graph.imports(product[mod]) if t == path[1])
        found.append(Violation("no-import-cycle", product[mod], " -> ".join(path), line, CYCLE_WHY))
    return found


def scan(graph: Graph | None = None) -> list[Violation]:
    graph = graph or Graph()
    return [v for rel in graph.sources for v in check(graph, rel)] + import_cycles(graph)


def test_no_new_architecture_violations():
    found = scan()
    new = [v for v in found if v.key not in KNOWN]
    gone = sorted(set(KNOWN) - {v.key for v in found})
    if gone:
        warnings.warn("KNOWN entries that no longer occur: " + ", ".join(map(str, gone)), stacklevel=1)
    shown = sorted({str(v) for v in new})
    assert not new, "architecture violations (fix them; if deliberate and temporary, add to KNOWN with a reason):\n" + (
        "\n".join(f"  {v}" for v in shown)
    )


def test_the_folders_are_the_parts():
    graph = Graph()
    for pkg in ("model/train", "model/bulk", "service/http", "service/runtime", "service/runtime/workers"):
        assert f"{pkg}/__init__.py" in graph.sources, pkg
    flat = [
        rel
        for rel in graph.sources
        if rel.count("/") == 1 and rel.split("/")[1].startswith(("cli_", "bulk_")) and not rel.startswith("bench/")
    ]  # a benchmark is named after what it measures (bench/bulk_speed.py)
    assert not flat, f"a prefix standing in for a folder: {flat}"


# --- the checker itself: each rule fails on a planted violation ----------------------------------
def planted(files: dict[str, str], rel: str) -> set[tuple[str, str, str]]:
    return {v.key for v in check(Graph(extra=files), rel)}


def test_the_runtime_reaching_fastapi_one_hop_away_is_caught():
    files = {
        "service/runtime/x.py": "from service.runtime.y import helper\n",
        "service/runtime/y.py": "from fastapi import Request\n\ndef helper():\n    pass\n",
    }
    assert ("runtime-knows-no-http", "service/runtime/x.py", "fastapi") in planted(files, "service/runtime/x.py")
    assert planted({"service/runtime/x.py": "import asyncio\n"}, "service/runtime/x.py") == set()


def test_the_model_processes_reaching_the_engine_are_caught():
    files = {
        "service/runtime/workers/x.py": "from service.runtime.workers.backend import LoadSpec\n"
        "from service.runtime.batcher import Batcher\n"
    }
    found = planted(files, "service/runtime/workers/x.py")
    assert ("workers-know-no-engine", "service/runtime/workers/x.py", "service.runtime.batcher") in found
    files = {"service/runtime/workers/x.py": "from service.runtime.layout import quiet_gc\n"}  # its closure: not passed
    assert planted(files, "service/runtime/workers/x.py") == set()


def test_the_engine_as_it_is_reaches_no_http():
    reached = Graph().closure("service/runtime/engine.py")
    assert not [m for m in reached if m.startswith(("fastapi", "starlette", "service.http"))]


def test_the_model_core_reaching_a_wing_or_the_service_is_caught():
    files = {"model/x.py": "def f():\n    from model.train.loop import train\n"}
    assert ("model-core-knows-no-wing", "model/x.py", "model.train") in planted(files, "model/x.py")
    files = {"model/x.py": "from model.levels import unit_score\nimport torch\n"}
    assert planted(files, "model/x.py") == set()


def test_the_wings_reaching_each_other_are_caught():
    files = {"model/bulk/x.py": "from model.train.evaluate import score_dataset\n"}
    assert ("bulk-wing-stands-apart", "model/bulk/x.py", "model.train") in planted(files, "model/bulk/x.py")
    files = {"model/train/x.py": "from model.bulk.score import score_file\n"}
    assert ("train-wing-stands-apart", "model/train/x.py", "model.bulk") in planted(files, "model/train/x.py")


def test_http_past_the_engine_or_onto_torch_is_caught():
    files = {
        "service/http/x.py": (
            "from service.runtime.engine import Engine\n"  # the gateway: fine
            "from model.levels import unit_score\n"  # torch-free: fine
            "from service.http.y import f\n"
        ),
        "service/http/y.py": "from service.runtime.workers.worker import Worker\nimport torch\n",
    }
    found = planted(files, "service/http/x.py")
    assert ("http-goes-through-the-engine", "service/http/x.py", "service.runtime.workers.worker") in found
    assert ("http-goes-through-the-engine", "service/http/x.py", "torch") in found
    assert not any(what == "service.runtime.engine" for _, _, what in found)


def test_the_batcher_reaching_the_model_is_caught():
    files = {"service/runtime/batcher.py": "from service.tracing import Tracing\nimport heapq\n"}
    found = planted(files, "service/runtime/batcher.py")
    assert ("batcher-knows-no-model", "service/runtime/batcher.py", "service.tracing") in found


def test_http_reaching_into_the_worker_or_a_private_name_is_caught():
    src = "from service.runtime.engine import _version\ndef live(engine):\n    return engine.worker.alive()\n"
    found = planted({"service/http/x.py": src}, "service/http/x.py")
    assert ("private-import", "service/http/x.py", "service.runtime.engine._version") in found
    assert ("http-reaches-engine-internals", "service/http/x.py", "worker") in found


def test_an_oversized_file_is_caught():
    assert ("file-size", "service/x.py", "lines") in planted(
        {"service/x.py": "x = 1\n" * (MAX_LINES + 1)}, "service/x.py"
    )
    assert planted({"service/x.py": "x = 1\n" * MAX_LINES}, "service/x.py") == set()


def test_bench_reaching_past_the_public_names_is_caught():
    hack = "import sys\nsys.path.insert(0, 'bench')\nimport model.bert  # noqa: E402\n"
    assert planted({"bench/x.py": hack}, "bench/x.py") == {
        ("bench-sys-path", "bench/x.py", "sys.path"),
        ("bench-import-below-code", "bench/x.py", "E402"),
    }
    private = "from model import _attention\nimport model._attention\nv = m._openvino\nw = self._ok\n"
    assert planted({"bench/x.py": private}, "bench/x.py") == {
        ("private-import", "bench/x.py", "model._attention"),
        ("bench-private-name", "bench/x.py", "model._attention"),
        ("bench-private-name", "bench/x.py", "m._openvino"),
    }
    assert planted({"bench/x.py": "from model.relevance import RelevanceModel\n"}, "bench/x.py") == set()


def test_importing_lab_is_caught():
    assert ("imports-lab", "bench/x.py", "lab.isa_peak") in planted(
        {"bench/x.py": "import lab.isa_peak\n"}, "bench/x.py"
    )
    assert ("imports-lab", "service/x.py", "lab") in planted({"service/x.py": "from lab import x\n"}, "service/x.py")


def test_an_oversized_benchmark_is_caught():
    assert ("file-size", "bench/x.py", "lines") in planted({"bench/x.py": "x = 1\n" * (MAX_LINES + 1)}, "bench/x.py")


def test_an_import_circle_is_caught():
    files = {
        "model/x.py": "from model.y import f\n",
        "model/y.py": "def f():\n    from model.z import g\n",  # in a function: still a circle
        "model/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model.x import X\n",
    }
    found = {v.key for v in import_cycles(Graph(extra=files))}
    assert ("no-import-cycle", "model/x.py", "model.x -> model.y -> model.z -> model.x") in found
    files["model/z.py"] = "import model.levels\n"
    assert not any("model.x" in what for _, _, what in {v.key for v in import_cycles(Graph(extra=files))})
