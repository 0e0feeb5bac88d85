"""The documents keep up with the code: every module has an owner in CONTRIBUTING.md, every setting and route
is in the reference, the README stays short and its own quick-start example answers what it says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 12 * 1024
RUN = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && qtrel serve"
TEST = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[test,train]' "
    "&& python -m pytest -q"
)


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for part in ("model", "service")
        for p in (ROOT / part).rglob("*.py")
        if p.name != "__init__.py"
    }


def ownership_table() -> str:
    text = read("CONTRIBUTING.md")
    start = text.index("## Layout, and who owns what")
    return text[start : text.index("\n## ", start + 1)]


def test_every_module_has_an_owner_in_contributing():
    listed = set(re.findall(r"`((?:model|service)/[\w/]+\.py)`", ownership_table()))
    missing = sorted(modules() - listed)
    assert not missing, (
        "modules missing from CONTRIBUTING.md's ownership table (add each, by its path, to the row of the part "
        f"that owns it): {', '.join(missing)}"
    )
    gone = sorted(listed - modules())
    assert not gone, f"CONTRIBUTING.md's ownership table lists modules that do not exist: {', '.join(gone)}"


def test_the_ownership_rule_sees_a_missing_module():
    listed = set(re.findall(r"`((?:model|service)/[\w/]+\.py)`", ownership_table()))
    assert "service/runtime/batcher.py" in listed and "model/train/cutoffs.py" in listed
    assert modules() - (listed - {"model/bert.py"}) == {"model/bert.py"}  # one left out is found, by name


def test_every_setting_is_in_the_configuration_reference():
    from service.settings import Settings

    doc = read("docs/configuration.md")
    missing = [name for name in Settings.model_fields if f"`{name}`" not in doc]
    assert not missing, f"settings missing from docs/configuration.md: {', '.join(missing)}"


def test_every_route_is_in_the_api_reference():
    from service.app import create_app
    from service.settings import Settings

    paths = create_app(Settings()).openapi()["paths"]  # the app is built, its lifespan (and model) never starts
    doc = read("docs/api.md")
    missing = sorted(p for p in paths if _shown(p) not in doc)
    assert not missing, f"routes missing from docs/api.md: {', '.join(missing)}"


def _shown(path: str) -> str:
    """A route as the reference writes it, up to its first parameter (`/v1/models/{id}` for {model_id})."""
    return path.split("{")[0]


def test_the_readme_is_short_and_its_two_commands_are_the_ones_that_work():
    text = read("README.md")
    assert len(text.encode()) <= README_LIMIT, f"README.md is {len(text.encode())} bytes; at most {README_LIMIT}"
    assert RUN in text and TEST in text
    for link in re.findall(r"\]\(((?:docs/|CONTRIBUTING|CHANGELOG)[^)#]*)", text):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


# A script path as the documents name it: bench/…py or lab/…py, not part of a longer path (docs/bench/…).
SCRIPT_PATH = re.compile(r"(?<![\w/.-])((?:bench|lab)/[\w/.-]*?\.py)\b")


def script_paths(text: str) -> set[str]:
    return set(SCRIPT_PATH.findall(text))


def test_every_script_the_documents_name_exists():
    """A study moved to lab/ is named by its lab/ path, a harness module by bench/harness/'s."""
    documents = ["README.md", "CONTRIBUTING.md", "bench/README.md", "lab/README.md"]
    documents += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    missing = sorted(
        f"{doc}: {path}" for doc in documents for path in script_paths(read(doc)) if not (ROOT / path).is_file()
    )
    assert not missing, "documents name scripts that do not exist:\n" + "\n".join(missing)


def test_the_script_path_rule_finds_what_a_reader_would_follow():
    text = "run `python bench/load.py`, see lab/level1_cut.py (docs/bench/cpu/x.py is data; bench/harness/live.py)"
    assert script_paths(text) == {"bench/load.py", "lab/level1_cut.py", "bench/harness/live.py"}
    assert script_paths("the old bench/level1_cut.py") == {"bench/level1_cut.py"}  # gone: the test above names it


def test_the_changelog_has_one_group_of_each_kind_per_release_and_no_internal_numbers():
    text = read("CHANGELOG.md")
    releases = re.split(r"^## ", text, flags=re.M)[1:]
    assert releases[0].startswith("[Unreleased]")
    for release in releases:
        heads = re.findall(r"^### (\w+)", release, flags=re.M)
        assert len(heads) == len(set(heads)), f"{release.splitlines()[0]}: a group twice: {heads}"
    internal = re.findall(r"(?i)\bissues? \d+|#\d+\b", text)
    assert not internal, f"internal issue numbers in CHANGELOG.md: {internal[:5]}"


# --- the README's quick start, against the real server on the built-in default model ----------------
def quick_start_examples() -> list[tuple[str, dict, dict]]:
    """Each `curl ... -d '<json>'` of the README's quick start with the JSON answer shown after it."""
    text = read("README.md")
    start = text.index("## Quick start")
    section = text[start : text.index("\n## ", start + 1)]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    out = []
    for (kind, body), (next_kind, answer) in zip(blocks, blocks[1:]):
        if kind == "bash" and "curl" in body and next_kind == "json":
            path = re.search(r"localhost:8080(/[\w/]+)", body)
            sent = re.search(r"-d '(.*?)'", body, flags=re.S)
            assert path and sent, body
            out.append((path.group(1), json.loads(sent.group(1)), json.loads(answer)))
    return out


def test_the_readme_has_quick_start_examples():
    assert [p for p, _, _ in quick_start_examples()] == ["/score", "/score"]


@pytest.mark.slow
def test_the_readme_quick_start_answers_as_documented():
    from model.builtin import resolve_model
    from tests.service.conftest import live_server

    # the precision `qtrel serve` picks here; no warm-up, which builds kernels and changes no score
    with live_server(resolve_model(None), dtype="auto", warmup=False) as srv:
        for path, sent, shown in quick_start_examples():
            got = httpx.post(srv.url + path, json=sent, timeout=60).json()
            assert got["model"] == shown["model"]
            assert got.get("below_cutoff") == shown.get("below_cutoff")
            assert len(got["results"]) == len(shown["results"])
            for g, s in zip(got["results"], shown["results"]):
                assert g.keys() == s.keys()  # the shape shown is the shape served
                assert (g["index"], g["level"], g["tokens"], g["truncated"]) == (
                    s["index"],
                    s["level"],
                    s["tokens"],
                    s["truncated"],
                )
                assert g["score"] == pytest.approx(s["score"], abs=0.02)  # shown to 2 decimals, any precision
                if "probs" in s:
                    assert g["probs"] == pytest.approx(s["probs"], abs=0.02)
