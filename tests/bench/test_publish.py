"""The publisher replaces a benchmark's table for a machine kind and leaves every other table as it was."""

from __future__ import annotations

import importlib.util

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_publish", ROOT / "bench" / "harness" / "publish.py")
assert spec is not None and spec.loader is not None
publish = importlib.util.module_from_spec(spec)
spec.loader.exec_module(publish)

DOC = """# Benchmarks

<!-- bench:load:zen-4:start -->
old zen-4 load
<!-- bench:load:zen-4:end -->

<!-- bench:load:zen-3:start -->
zen-3 load
<!-- bench:load:zen-3:end -->

<!-- bench:memory:zen-4:start -->
zen-4 memory
<!-- bench:memory:zen-4:end -->
"""


def test_a_rerun_replaces_its_table_and_nothing_else():
    out = publish.replace_section(DOC, "load", "zen-4", "new zen-4 load")
    assert "old zen-4 load" not in out and out.count("new zen-4 load") == 1
    assert out.replace("new zen-4 load", "old zen-4 load") == DOC
    assert publish.replace_section(out, "load", "zen-4", "new zen-4 load") == out  # a re-run: the same text


def test_a_new_kind_goes_after_its_benchmarks_tables():
    out = publish.replace_section(DOC, "load", "sapphire-rapids", "amx load")
    assert out.index("zen-3 load") < out.index("amx load") < out.index("zen-4 memory")


def test_a_new_benchmark_goes_to_its_place_holder():
    doc = "# B\n\n## Serving\n\n<!-- bench:load -->\n\n## Memory\n"
    out = publish.replace_section(doc, "load", "zen-4", "load table")
    assert out.index("## Serving") < out.index("load table") < out.index("## Memory")
    again = publish.replace_section(out, "load", "zen-3", "zen-3 table")
    assert out.index("load table") < again.index("zen-3 table") < again.index("## Memory")


def test_a_new_benchmark_goes_at_the_end():
    out = publish.replace_section(DOC, "bulk_speed", "zen-4", "bulk")
    assert out.startswith(DOC.rstrip()) and out.rstrip().endswith("<!-- bench:bulk_speed:zen-4:end -->")


def test_raw_results_go_under_their_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("QTREL_BENCH_QUICK_DIR", str(tmp_path))
    assert publish.output_paths("load", "zen-4", quick=False) == (publish.DOCS, publish.RAW / "zen-4" / "load.json")
    assert publish.output_paths("load", "zen-4", quick=True) == (
        tmp_path / "benchmarks.md",
        tmp_path / "zen-4" / "load.json",
    )
