"""HTTP routes. Each handler validates, submits to the engine and shapes the response."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from model.levels import raw_level_scores, raw_score
from service.errors import ErrorKind, ServiceError
from service.http import cutoff
from service.http.deps import EngineDep, MetricsDep, SettingsDep, TimeoutHeader, UseCacheDep
from service.http.priority import OPENAPI as PRIORITY_HEADER
from service.http.priority import priority_of
from service.http.schemas import (
    ErrorBody,
    Info,
    Prediction,
    PredictRequest,
    Rank,
    RerankRequest,
    ScoreRequest,
    ScoreResponse,
)
from service.logs import keep_private
from service.metrics import Metrics
from service.runtime.engine import EngineAPI, NotReady, Scored
from service.settings import Settings

router = APIRouter()  # scoring and /info: protected by an API key when keys are set (app.PROTECTED_ROUTERS)
ops_router = APIRouter()  # health: always open (probes carry no key)
metrics_router = APIRouter()  # /metrics: open unless protect_metrics
ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": ErrorBody} for c in (400, 401, 403, 404, 408, 413, 422, 429, 499, 500, 503)
}
WARNING_HEADER = "X-Qtrel-Warning"  # TEI /rerank's unknown_share_warn warning (its body is a bare list)
log = logging.getLogger("qtrel.http")
LOGGED_TEXTS = 20  # with log_texts on, the first queries and titles of a request logged at debug


def check_limits(s: Settings, queries: list[str], titles: list[str]) -> None:
    """Every route calls it with the texts it takes, before anything else is done with them: the texts are
    kept out of the logs (or, with log_texts on, logged at debug), then their limits are checked (413). The
    schema states the same limits (service/openapi.py)."""
    if s.log_texts:
        if log.isEnabledFor(logging.DEBUG):
            uniq = list(dict.fromkeys(queries))
            log.debug(
                "texts of %d pairs: queries %s, titles %s",
                len(titles),
                json.dumps(uniq[:LOGGED_TEXTS], ensure_ascii=False),
                json.dumps(titles[:LOGGED_TEXTS], ensure_ascii=False),
            )
    else:
        keep_private([*queries, *titles])
    if len(titles) > s.max_pairs_per_request:
        raise ServiceError(ErrorKind.TOO_LARGE, f"{len(titles)} pairs; at most {s.max_pairs_per_request} per request")
    for what, texts in (("query", queries), ("title", titles)):
        for i, t in enumerate(texts):
            if len(t) > s.max_text_chars:
                raise ServiceError(
                    ErrorKind.TOO_LARGE, f"{what} {i} has {len(t)} characters; at most {s.max_text_chars}"
                )


async def score_watched(
    request: Request,
    engine: EngineAPI,
    settings: Settings,
    metrics: Metrics,
    queries,
    titles,
    timeout_ms,
    max_chunks: int | None = None,
    chunk_overlap: int | None = None,
    **kw,
) -> Scored:
    """Score (each long title in at most `max_chunks` windows, when given), dropping the work the moment the
    client disconnects: its queued pairs never reach the model. A client already gone costs no tokenisation.
    The hang-up cancels this very task (no second task, no `asyncio.wait`: ~15 us a request less). A pair
    whose unknown share is over unknown_share_refuse is refused (422) before any pair is forwarded."""
    check_limits(settings, queries, titles)
    if settings.unknown_share_refuse is not None:
        kw["max_unknown"] = settings.unknown_share_refuse
    gone = asyncio.ensure_future(disconnected(request))
    await asyncio.sleep(0)  # let it see a hang-up that came with the body
    if not gone.done():
        me = asyncio.current_task()
        assert me is not None
        watching, hung_up = True, False

        def hang_up(f: asyncio.Future) -> None:
            nonlocal hung_up
            if watching and not f.cancelled():  # a callback already queued when the scoring ended does nothing
                hung_up = True
                me.cancel()

        gone.add_done_callback(hang_up)
        try:
            if max_chunks is None:
                return await engine.score(queries, titles, timeout_ms=timeout_ms, **kw)
            return await engine.score_windows(queries, titles, max_chunks, chunk_overlap, timeout_ms=timeout_ms, **kw)
        except asyncio.CancelledError:
            if not hung_up:
                raise
            me.uncancel()  # our own cancellation: it ends as the client-closed error below
        finally:
            watching = False
            gone.cancel()
    metrics.rejected.labels("disconnected").inc()
    raise ServiceError(ErrorKind.CLIENT_CLOSED, "client closed the connection")


def unread_warning(scored: Scored, settings: Settings) -> str | None:
    """The warning of a response whose pairs the model mostly cannot read (over unknown_share_warn), if any."""
    limit = settings.unknown_share_warn
    if not (unread := [i for i, x in enumerate(scored.unknown) if x > limit]):
        return None
    return (
        f"{scored.model} cannot read most of pair(s) {unread[:10]} (over {limit:.0%} unknown tokens, see "
        "unknown_share): their grades are not meaningful; GET /v1/models lists the languages each model reads"
    )


def window_of(scored: Scored, i: int) -> dict[str, Any] | None:
    """The window whose scores document i got (`WindowResult`), where the request asked for windows."""
    if scored.picks is None:
        return None
    p = scored.picks[i]
    return {"index": p.index, "count": p.count, "start": p.start, "end": p.end}


async def disconnected(request: Request) -> None:
    """Returns when the client hangs up: after the body, the ASGI server's next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/score", response_model=ScoreResponse, responses=ERRORS, tags=["scoring"], openapi_extra=PRIORITY_HEADER)
async def score(
    body: ScoreRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    use_cache: UseCacheDep,
    timeout_ms: TimeoutHeader = None,
):
    """Grade each (query, title) pair: level, expected-level score, probabilities per level."""
    queries, titles = body.as_pairs()
    scored = await score_watched(
        request,
        engine,
        settings,
        metrics,
        queries,
        titles,
        timeout_ms,
        body.max_chunks,
        body.chunk_overlap,
        truncation=body.truncation,
        use_cache=use_cache,
        model=body.model,
        priority=priority_of(body, request),
    )
    labels = scored.labels
    floor = cutoff.level_floor(body.min_level, labels, scored.model)
    shares = scored.unknown
    results, below = [], 0
    for i, (out, n, cut) in enumerate(zip(scored.outputs, scored.lengths, scored.truncated)):
        if not cutoff.kept(out.level, out.expected, floor, body.min_score):
            below += 1
            continue
        r: dict[str, Any] = {
            "index": i,
            "level": labels[out.level],
            "score": raw_score(out.logits) if body.raw_scores else out.expected,
            "tokens": n,
            "truncated": cut,
            "unknown_share": round(shares[i], 4),
        }
        if body.return_probs:
            r["probs"] = dict(zip(labels, out.probs))
        if (w := window_of(scored, i)) is not None:
            r["window"] = w
        results.append(r)
    if body.top_n is not None:
        results = sorted(results, key=lambda r: -r["score"])[: body.top_n]
    response: dict[str, Any] = {"model": scored.model, "results": results}
    headers = {}
    if floor is not None or body.min_score is not None:
        response["below_cutoff"] = below
        headers[cutoff.HEADER] = str(below)
    if warning := unread_warning(scored, settings):
        response["warnings"] = [warning]
    return JSONResponse(response, headers=headers)


@router.post(
    "/predict",
    response_model=list[Prediction] | list[list[Prediction]],
    responses=ERRORS,
    openapi_extra=PRIORITY_HEADER,
    tags=["text-embeddings-inference"],
)
async def predict(
    body: PredictRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    use_cache: UseCacheDep,
    timeout_ms: TimeoutHeader = None,
):
    """TEI-compatible: per input, every level with its probability (or logit with raw_scores), best first."""
    queries, titles = body.as_pairs()
    scored = await score_watched(
        request,
        engine,
        settings,
        metrics,
        queries,
        titles,
        timeout_ms,
        side=body.truncation_direction.lower(),
        allow_truncation=bool(body.truncate),
        use_cache=use_cache,
        priority=priority_of(body, request),
    )
    labels = scored.labels
    out = []
    for o in scored.outputs:
        if body.raw_scores:
            ranked = raw_level_scores(o.logits, labels)
        else:
            ranked = sorted(zip(o.probs, labels), key=lambda p: -p[0])
        out.append([{"score": v, "label": lab} for v, lab in ranked])
    return JSONResponse(out[0] if body.single else out)


@router.post(
    "/rerank",
    response_model=list[Rank],
    responses=ERRORS,
    tags=["text-embeddings-inference"],
    openapi_extra=PRIORITY_HEADER,
)
async def rerank(
    body: RerankRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    use_cache: UseCacheDep,
    timeout_ms: TimeoutHeader = None,
):
    """TEI-compatible: texts ranked for the query by expected level (raw_scores: raw logit), best first."""
    scored = await score_watched(
        request,
        engine,
        settings,
        metrics,
        [body.query] * len(body.texts),
        body.texts,
        timeout_ms,
        body.max_chunks,
        body.chunk_overlap,
        side=body.truncation_direction.lower(),
        allow_truncation=bool(body.truncate),
        use_cache=use_cache,
        priority=priority_of(body, request),
    )
    floor = cutoff.level_floor(body.min_level, scored.labels, scored.model)
    ranks = []
    for i, o in enumerate(scored.outputs):
        if not cutoff.kept(o.level, o.expected, floor, body.min_score):
            continue
        r: dict[str, Any] = {
            "index": i,
            "score": raw_score(o.logits) if body.raw_scores else o.expected,
            "unknown_share": round(scored.unknown[i], 4),
        }
        if body.return_text:
            r["text"] = body.texts[i]
        if (w := window_of(scored, i)) is not None:
            r["window"] = w
        ranks.append(r)
    headers = {} if floor is None and body.min_score is None else {cutoff.HEADER: str(len(scored.outputs) - len(ranks))}
    if warning := unread_warning(scored, settings):  # TEI's answer is a bare list: the warning goes in a header
        headers[WARNING_HEADER] = warning
    return JSONResponse(sorted(ranks, key=lambda r: -r["score"]), headers=headers)


# --- operations ----------------------------------------------------------------------------
@ops_router.get("/health/live", tags=["operations"])
@ops_router.get("/livez", include_in_schema=False)
async def live(engine: EngineDep):
    """200 while the process and its model worker are alive."""
    ok, state = engine.liveness()
    if not ok:
        raise ServiceError(ErrorKind.NOT_READY, f"worker is not running ({state})")
    return {"status": "alive"}


@ops_router.get("/health/ready", tags=["operations"], responses={503: {"model": ErrorBody}})
@ops_router.get("/readyz", include_in_schema=False)
async def ready(engine: EngineDep):
    """200 once the model is loaded and warmed up; 503 before that and while draining."""
    ok, why = engine.readiness()
    if not ok:
        raise NotReady(why)
    return {"status": "ready"}


@metrics_router.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
async def metrics(engine: EngineDep):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(await engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)


@router.get("/info", response_model=Info, responses={401: {"model": ErrorBody}}, tags=["operations"])
async def info(engine: EngineDep):
    """The model, its levels and limits, and the effective settings."""
    return Info(**await engine.info())
