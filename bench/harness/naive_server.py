"""The naive baseline for bench/load.py: `transformers` BertForSequenceClassification, one forward per
request, no batching across requests. It accepts the body of qtrel's `POST /score` (one query with
titles, or pairs) and answers levels and expected-level scores.

  python bench/harness/naive_server.py --model DIR --port 8091 --threads 2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel


class Pair(BaseModel):
    query: str
    title: str


class ScoreRequest(BaseModel):
    query: str | None = None
    titles: list[str] | None = None
    pairs: list[Pair] | None = None
    return_probs: bool = False  # accepted for compatibility with qtrel's body; ignored


class NaiveScorer:
    """Tokenizer and model of one checkpoint; every call is one forward over that call's pairs."""

    def __init__(self, model_dir: Path, max_length: int = 128):
        from transformers import AutoTokenizer, BertForSequenceClassification

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model: Any = BertForSequenceClassification.from_pretrained(str(model_dir), attn_implementation="sdpa")
        self.model = self.model.float().eval()
        self.max_length = max_length
        labels = [self.model.config.id2label[i] for i in range(self.model.config.num_labels)]
        self.labels = labels
        self.values = torch.tensor([float(x) for x in labels])

    def score(self, queries: list[str], titles: list[str]) -> list[dict]:
        enc = self.tokenizer(
            queries, titles, truncation="only_second", max_length=self.max_length, padding=True, return_tensors="pt"
        )
        with torch.inference_mode():
            probs = self.model(**enc).logits.float().softmax(-1)
        levels = probs.argmax(-1).tolist()
        scores = (probs @ self.values).tolist()
        return [{"index": i, "level": self.labels[k], "score": s} for i, (k, s) in enumerate(zip(levels, scores))]


router = APIRouter()


@router.get("/health")
def health() -> dict:
    return {"status": "ok"}


@router.post("/score")
def score(body: ScoreRequest, request: Request) -> dict:  # sync: FastAPI runs it on its thread pool
    if body.pairs is not None:
        queries, titles = [p.query for p in body.pairs], [p.title for p in body.pairs]
    else:
        queries, titles = [body.query or ""] * len(body.titles or []), list(body.titles or [])
    return {"results": request.app.state.scorer.score(queries, titles)}


def create_app(scorer: NaiveScorer) -> FastAPI:
    app = FastAPI(title="naive transformers baseline")
    app.state.scorer = scorer
    app.include_router(router)
    return app


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    app = create_app(NaiveScorer(a.model))
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
