"""The pair-score cache under search traffic: a skewed trace of real Home Depot dev queries replayed against
a real `qtrel serve` with the cache on (`--cache-mb 64`) and off (`--cache-mb 0`), interleaved.

Traces (fixed by --seed, the same bytes for both servers):
- skewed: each request is one dev query with its candidate titles (all of its judged titles, 1-16, ~6),
  the query drawn Zipf(--zipf) over the 1,143 dev queries (ranked in a random order); a share
  (--dup-share) of the requests lists one of its titles twice (an exact duplicate pair). ~80% of its pairs
  repeat a pair sent earlier in the trace.
- no repeats: each of the first --fresh-queries dev queries once with its titles: every pair new, so the
  cache only costs (lookups, copies, stores) and never answers; it shows what the miss path costs.

Each window starts a fresh server (a cold cache, no pair of another window held), replays one trace with
--clients closed-loop aiohttp clients and stops the server; rounds alternate which server goes first, and
the speed-up is the median of the per-round ratios (drift of this shared machine hits both alike).
Reports pairs/s, p50/p99 per request, the server's hit rate and pairs forwarded (qtrel_batch_pairs), and
whether both servers answered the same scores.

  python lab/cache_replay.py            # into docs/benchmarks.md (section cache-replay), docs/bench/
  python lab/cache_replay.py --quick    # smoke run, nothing written
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import statistics
import sys
import time
from collections import defaultdict

from live import Server, pct, post_all
from results import DEV, ROOT, command_line, machine, machine_lines, output_paths, update_section, write_json

Trace = list[tuple[str, list[str]]]  # (query, titles) per request


def candidates() -> list[tuple[str, list[str]]]:
    by_query: dict[str, list[str]] = defaultdict(list)
    with DEV.open(encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if r["title"] not in by_query[r["query"]]:
                by_query[r["query"]].append(r["title"])
    return list(by_query.items())


def skewed(queries: list[tuple[str, list[str]]], n: int, s: float, dup_share: float, seed: int) -> Trace:
    rng = random.Random(seed)
    ranked = queries[:]
    rng.shuffle(ranked)
    weights = [1 / (r + 1) ** s for r in range(len(ranked))]
    trace = []
    for q, titles in rng.choices(ranked, weights, k=n):
        titles = titles[:]
        if rng.random() < dup_share:
            titles.insert(rng.randrange(len(titles) + 1), rng.choice(titles))
        trace.append((q, titles))
    return trace


def repeated_share(trace: Trace) -> float:
    seen: set[tuple[str, str]] = set()
    again = total = 0
    for q, titles in trace:
        for t in titles:
            again += (q, t) in seen
            seen.add((q, t))
            total += 1
    return again / total


async def replay(url: str, trace: Trace, clients: int) -> dict:
    bodies = [json.dumps({"query": q, "titles": ts, "return_probs": False}).encode() for q, ts in trace]
    got, latencies, wall = await post_all(url + "/score", bodies, clients)
    answers = [None if a is None else [x["score"] for x in a["results"]] for a in got]
    failed = answers.count(None)
    pairs = sum(len(ts) for _, ts in trace)
    return {
        "pairs": pairs,
        "seconds": wall,
        "pairs_per_s": pairs / wall,
        "p50_ms": pct(latencies, 0.5),
        "p99_ms": pct(latencies, 0.99),
        "failed": failed,
        "answers": answers,
    }


def window(model: str, cache_mb: int, trace: Trace, clients: int, extra: list[str]) -> dict:
    srv = Server(model, "--cache-mb", str(cache_mb), *extra)
    try:
        srv.wait_ready()
        out = asyncio.run(replay(srv.url, trace, clients))
        hits, misses = srv.metric("qtrel_cache_hits_total"), srv.metric("qtrel_cache_misses_total")
        out["hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
        out["forwarded"] = srv.metric("qtrel_batch_pairs_sum")
        out["folded"] = srv.metric("qtrel_duplicates_folded_total")
        out["cache_bytes"] = srv.metric("qtrel_cache_bytes")
    finally:
        srv.stop()
    return out


def spread(trace: Trace, answers: list) -> float:
    """The largest difference between two answers for the same pair within one server's run: 0 when every
    repeat is answered bit-identically (a cache hit); in bfloat16 a pair forwarded again in another batch
    can differ by ~1e-2 (what else shared the batch changes the rounding)."""
    seen: dict[tuple[str, str], tuple[float, float]] = {}
    for (q, ts), scores in zip(trace, answers):
        for t, x in zip(ts, scores or []):
            lo, hi = seen.get((q, t), (x, x))
            seen[(q, t)] = (min(lo, x), max(hi, x))
    return max((hi - lo for lo, hi in seen.values()), default=0.0)


def largest_difference(a: list, b: list) -> float:
    """The largest |score difference| of a request's pair between two servers' runs."""
    worst = 0.0
    for x, y in zip(a, b):
        if x is not None and y is not None:
            worst = max([worst, *(abs(p - q) for p, q in zip(x, y))])
    return worst


def miss_path_us(trace: Trace) -> float:
    """What the cache adds to a pair it does not hold, in this process: the key, the lookup that misses,
    and the store of the forward's result (packed, LRU bookkeeping), microseconds per pair."""
    sys.path.insert(0, str(ROOT))
    from model.levels import PairScore, pack_row
    from service.runtime.cache import Cached, ScoreCache, make_key

    pairs = [(q, t) for q, ts in trace for t in ts]
    out = Cached(pack_row(PairScore([0.1] * 5, [0.2] * 5, 2, 3.1)), 24, False, 0.0)
    best = float("inf")
    for _ in range(5):
        cache = ScoreCache(64 << 20)
        t0 = time.perf_counter()
        for q, t in pairs:
            k = make_key("qtrel-minilm-homedepot-v2", 1, "only_second", "right", 128, q, t)
            if cache.get(k) is None:
                cache.put(k, out)
        best = min(best, (time.perf_counter() - t0) / len(pairs) * 1e6)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:default")
    ap.add_argument("--requests", type=int, default=1200, help="requests in the skewed trace")
    ap.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent over the dev queries")
    ap.add_argument("--dup-share", type=float, default=0.1, help="share of requests with a title twice")
    ap.add_argument("--fresh-queries", type=int, default=300, help="queries in the no-repeat trace")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: small traces, one round, nothing written")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.fresh_queries, a.rounds = 120, 40, 1
    queries = candidates()
    traces = {
        "skewed": skewed(queries, a.requests, a.zipf, a.dup_share, a.seed),
        "no repeats": queries[: a.fresh_queries],
    }
    shares = {name: repeated_share(t) for name, t in traces.items()}
    miss_us = miss_path_us(traces["no repeats"])
    print(f"the cache on the miss path: {miss_us:.1f} us a pair (key, lookup, store)")
    for name, t in traces.items():
        print(f"{name}: {len(t)} requests, {sum(len(ts) for _, ts in t)} pairs, {shares[name]:.1%} repeated")
    runs: dict[str, dict[str, list[dict]]] = {n: {"on": [], "off": []} for n in traces}
    for r in range(a.rounds):
        for name, trace in traces.items():
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                out = window(a.model, 64 if mode == "on" else 0, trace, a.clients, [])
                runs[name][mode].append(out)
                print(
                    f"round {r} {name} cache {mode}: {out['pairs_per_s']:.0f} pairs/s, p50 {out['p50_ms']} ms, "
                    f"p99 {out['p99_ms']} ms, hit rate {out['hit_rate']:.1%}, forwarded {out['forwarded']:.0f}, "
                    f"failed {out['failed']}"
                )
    lines = [
        "| trace | pairs (repeated) | cache | pairs/s | p50 ms | p99 ms | hit rate | pairs forwarded | "
        "on / off pairs/s (per round) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    summary = {}
    for name, trace in traces.items():
        on, off = runs[name]["on"], runs[name]["off"]
        ratios = [x["pairs_per_s"] / y["pairs_per_s"] for x, y in zip(on, off)]
        summary[name] = {
            "speedup": statistics.median(ratios),
            "per_round": ratios,
            "max_diff_on_off": largest_difference(on[0]["answers"], off[0]["answers"]),
            "spread_on": max(spread(trace, x["answers"]) for x in on),
            "spread_off": max(spread(trace, x["answers"]) for x in off),
        }
        for mode, rs in (("on", on), ("off", off)):
            med = {k: statistics.median(x[k] for x in rs) for k in ("pairs_per_s", "p50_ms", "p99_ms", "hit_rate")}
            cell = (
                f"**{summary[name]['speedup']:.2f}×** ({', '.join(f'{x:.2f}' for x in ratios)})" if mode == "on" else ""
            )
            lines.append(
                f"| {name} | {rs[0]['pairs']} ({shares[name]:.0%}) | {mode} | {med['pairs_per_s']:.0f} | "
                f"{med['p50_ms']:.0f} | {med['p99_ms']:.0f} | {med['hit_rate']:.1%} | "
                f"{rs[0]['forwarded']:.0f} | {cell} |"
            )
    m = machine()
    body = "\n".join(
        [
            *machine_lines(m, command_line()),
            "- the CPU: AMD EPYC Zen 4 (AVX-512, AVX512-BF16, AVX512-VNNI, no AMX), 2 vCPUs **shared with a "
            "training job and other work** while this ran: absolute figures are pessimistic and noisy; the "
            "ratios are paired by round",
            f"- `qtrel serve --model {a.model}` (default layout and dtype) started afresh for each window, "
            f"`--cache-mb 64` (on) or `0` (off); {a.clients} closed-loop aiohttp clients on the same cores; "
            f"{a.rounds} rounds, on and off alternating first; medians over rounds",
            f"- skewed trace: {a.requests} requests, Zipf({a.zipf:g}) over the {len(queries)} dev queries, each with "
            f"its judged titles, {a.dup_share:.0%} of requests with a title twice; no repeats: the first "
            f"{a.fresh_queries} queries once",
            "",
            *lines,
            "",
            *(
                f"- {name}: the largest |score difference| of a pair between cache on and off "
                f"{s['max_diff_on_off']:.2g}; between two answers for the same pair within one run: cache on "
                f"{s['spread_on']:.2g}, cache off {s['spread_off']:.2g}"
                for name, s in summary.items()
            ),
            f"- the cache on the miss path, measured in-process over the no-repeat trace's pairs: {miss_us:.1f} µs a "
            "pair (key, lookup that misses, store of the result), against milliseconds for the pair's forward",
        ]
    )
    print("\n" + body)
    if not a.quick:
        md, raw = output_paths("cache_replay", False)
        for name in runs:
            for mode in runs[name]:
                for x in runs[name][mode]:
                    x.pop("answers", None)
        write_json(
            raw,
            {
                "machine": m,
                "command": command_line(),
                "runs": runs,
                "summary": summary,
                "shares": shares,
                "miss_path_us": miss_us,
            },
        )
        update_section(md, "cache-replay", body)
        print(f"wrote {raw} and the cache-replay section of {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
