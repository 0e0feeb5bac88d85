"""The text side of an engine: tokenising pairs, splitting long titles into windows and `/tokenize`.

Both engines share it: the one-process `Engine` (service.runtime.engine) and a front process's
`RemoteEngine` (service.runtime.remote), which tokenises here and sends token ids to the engine core. Each
says where a model's tokenizer is (`_tokenizer_of`) and how pairs are scored (`score`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from model.tokenizer import EncodedPairs
from model.windows import split_pairs
from service.metrics import Metrics
from service.runtime.results import Scored, Tokenized
from service.runtime.windows import TooManyWindows, flatten, reduce
from service.runtime.workers.worker_api import ModelInfo
from service.settings import Settings
from service.tracing import Tracing

# Requests with at most this many pairs are tokenised on the event loop (~50 us: cheaper than a hop to the
# tokeniser thread).
INLINE_PAIRS = 4


class TextSide:
    settings: Settings
    metrics: Metrics
    tracing: Tracing
    _tok_pool: ThreadPoolExecutor
    score: Callable[..., Awaitable[Scored]]  # the engine's own

    def _tokenizer_of(self, model: str | None, ready: bool) -> tuple[str, ModelInfo]:
        """The model's name and what it knows of itself (its tokenizer); `ready`: refuse while it cannot
        take work (NotReady), as scoring does."""
        raise NotImplementedError

    def model_info(self, model: str | None = None) -> tuple[str, ModelInfo]:
        """The served model's name and info, refused (NotReady, ModelNotFound) as scoring is: for score jobs."""
        return self._tokenizer_of(model, ready=True)

    async def _encode(
        self, model: ModelInfo, queries: list[str], titles: list[str], truncation: str, side: str
    ) -> EncodedPairs:
        t0 = time.perf_counter()
        tok = model.tokenizer
        with self.tracing.span("qtrel.tokenize", pairs=len(queries)) as span:
            if len(queries) <= INLINE_PAIRS:
                enc = tok.encode(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            else:
                enc = await asyncio.get_running_loop().run_in_executor(
                    self._tok_pool,
                    lambda: tok.encode(queries, titles, truncation=truncation, side=side),  # type: ignore[arg-type]
                )
            span.set_attribute("qtrel.tokens", sum(enc.lengths))
        self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        return enc

    async def score_windows(
        self, queries: list[str], titles: list[str], max_chunks: int, overlap: int | None = None, **options
    ) -> Scored:
        """`score`, each title longer than the model's window split into at most `max_chunks` windows that
        share `overlap` tokens (default: the chunk_overlap setting); a title gets its best window's scores
        (service.runtime.windows). The windows count against max_pairs_per_request."""
        _, info = self._tokenizer_of(options.get("model"), ready=True)
        n = self.settings.chunk_overlap if overlap is None else overlap
        args = (info.tokenizer, queries, titles, max_chunks, n)
        if len(titles) <= INLINE_PAIRS:
            docs = split_pairs(*args)
        else:
            docs = await asyncio.get_running_loop().run_in_executor(self._tok_pool, split_pairs, *args)
        if (windows := sum(map(len, docs))) > self.settings.max_pairs_per_request:
            raise TooManyWindows(windows, self.settings.max_pairs_per_request)
        s = await self.score(*flatten(queries, docs), **options)
        return reduce(s.outputs, s.lengths, s.truncated, docs, s.labels, s.model, s.unknown)

    async def tokenize(
        self,
        queries: list[str],
        titles: list[str],
        truncation: str = "only_second",
        side: str = "right",
        model: str | None = None,
    ) -> Tokenized:
        """The pairs' tokens under these truncation options, and what truncation kept and cut."""
        name, info = self._tokenizer_of(model, ready=False)
        tok = info.tokenizer

        def work() -> Tokenized:
            enc, cuts = tok.explain_truncation(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            return Tokenized(enc, [tok.tokens(ids) for ids in enc.input_ids], cuts, tok.tokens, info.max_length, name)

        if len(queries) <= INLINE_PAIRS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, work)
