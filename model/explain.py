"""Why a pair got its score: attention per layer and head, term-matching heads, occlusion attribution.

One pair at a time, inference only, on the plain attention path (the one that returns per-head
probabilities). Nothing here needs gradients, so it works on packed (oneDNN) and int8 models alike:
a token's attribution is the drop in expected level when that token alone is replaced by [MASK].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.levels import MAX_BATCH_TOKENS
from model.relevance import RelevanceModel, pad_batch
from model.scoring import merge_classes
from model.tokenizer import Truncation

SUMMARY_DECIMALS = 6  # per-head summaries and attributions
MATRIX_DECIMALS = 4  # full attention matrices (for the view page): keeps the JSON small


@dataclass
class PairLayout:
    """Where the query, the title and the special tokens sit in `[CLS] q [SEP] t [SEP]`."""

    length: int
    query: list[int]  # positions of query word pieces
    title: list[int]  # positions of title word pieces

    @classmethod
    def of(cls, token_type_ids: list[int]) -> PairLayout:
        T = len(token_type_ids)
        nq = token_type_ids.count(0) - 2  # [CLS] and the first [SEP] are segment 0
        return cls(T, list(range(1, 1 + nq)), list(range(nq + 2, T - 1)))

    @property
    def content(self) -> list[int]:
        return self.query + self.title

    def special(self, i: int) -> bool:
        return i == 0 or i == self.length - 1 or i == len(self.query) + 1


def _round(x: Tensor, decimals: int) -> list:
    # float64 first, so that 0.1234 prints as 0.1234 and not as float32's 0.12340000271797180
    return x.double().round(decimals=decimals).tolist()


def _occlusion_id(model: RelevanceModel) -> tuple[int, str]:
    for token in ("[MASK]", "[UNK]"):
        i = model.tokenizer.token_id(token)
        if i is not None and i < model.cfg.vocab_size:
            return i, token
    raise ValueError("the vocabulary has neither [MASK] nor [UNK] to occlude tokens with")


def cross_mass(att: Tensor, layout: PairLayout) -> tuple[Tensor, Tensor]:
    """(layers, nh, T, T) attention -> per head, the mean over query tokens of their attention to
    title tokens, and the mean over title tokens of their attention to query tokens (special tokens
    excluded on both sides). Each (layers, nh)."""
    if not layout.query or not layout.title:  # a text that normalises to nothing
        zero = torch.zeros(att.shape[:2])
        return zero, zero
    q, t = torch.tensor(layout.query), torch.tensor(layout.title)
    q2t = att[:, :, q][:, :, :, t].sum(-1).mean(-1)
    t2q = att[:, :, t][:, :, :, q].sum(-1).mean(-1)
    return q2t, t2q


def term_matching(att: Tensor, ids: list[int], layout: PairLayout) -> tuple[Tensor, Tensor] | None:
    """Per head, how much attention goes between identical word pieces across query and title: the
    mean over query tokens that occur in the title of their attention to those occurrences, and the
    same from the title side. Each (layers, nh); None when the pair shares no word piece."""
    if not layout.query or not layout.title:
        return None
    same = torch.tensor([[ids[i] == ids[j] for j in layout.title] for i in layout.query], dtype=att.dtype)
    if not same.any():
        return None
    q, t = torch.tensor(layout.query), torch.tensor(layout.title)
    q_rows = same.any(1)  # query tokens with a twin in the title
    t_rows = same.any(0)
    q2t = (att[:, :, q][:, :, :, t] * same).sum(-1)[:, :, q_rows].mean(-1)  # (layers, nh)
    t2q = (att[:, :, t][:, :, :, q] * same.T).sum(-1)[:, :, t_rows].mean(-1)
    return q2t, t2q


@torch.inference_mode()
def attentions(model: RelevanceModel, ids: list[int], seg: list[int]) -> tuple[Tensor, list[Tensor]]:
    """One pair on the plain path -> float32 cpu logits (levels,) and per layer (heads kept, T, T)."""
    x, s, m = pad_batch([ids], [seg], model.tokenizer.pad_id)
    dev = model.device
    logits, att = model.module(x.to(dev), s.to(dev), m.to(dev), output_attentions=True)
    assert att is not None
    merged = merge_classes(logits.float().cpu(), model.class_levels)  # per level, as model.logits returns
    return merged[0], [a[0].float().cpu() for a in att]


def occlusion(
    model: RelevanceModel, ids: list[int], seg: list[int], layout: PairLayout, max_batch_tokens: int = MAX_BATCH_TOKENS
) -> tuple[list[float | None], str]:
    """Score drop when each content token alone is replaced by [MASK] ([UNK] without one). The
    original pair rides in the same forward as its occluded copies, so each attribution is an exact
    difference of two scores from one pass; copies are split only beyond `max_batch_tokens`."""
    mask_id, token = _occlusion_id(model)
    copies = [ids]
    for i in layout.content:
        c = list(ids)
        c[i] = mask_id
        copies.append(c)
    rows = max(1, max_batch_tokens // len(ids))
    logits = torch.cat(
        [model.logits(copies[k : k + rows], [seg] * len(copies[k : k + rows])) for k in range(0, len(copies), rows)]
    )
    scores = model.score(logits).expected
    drop = (scores[0] - scores[1:]).double()
    out: list[float | None] = [None] * len(ids)
    for i, d in zip(layout.content, drop.round(decimals=SUMMARY_DECIMALS).tolist()):
        out[i] = d
    return out, token


def explain_pair(
    model: RelevanceModel,
    query: str,
    title: str,
    truncation: Truncation = "only_second",
    top_heads: int = 5,
    attention: bool = False,
) -> dict:
    """Everything the view page shows about one pair, as plain JSON-ready data (see the module doc).
    The pair is truncated to the model's max length, as for scoring; `attention` adds the full
    (layers, heads, T, T) matrices rounded to 4 decimals."""
    enc = model.tokenizer.encode([query], [title], truncation=truncation)
    ids, seg = enc.input_ids[0], enc.token_type_ids[0]
    layout = PairLayout.of(seg)
    logits, att_layers = attentions(model, ids, seg)
    scored = model.score(logits.unsqueeze(0))
    probs = scored.probs[0]
    cfg = model.cfg
    heads = [cfg.heads_in_layer(layer) for layer in range(cfg.num_hidden_layers)]

    # Pruned layers have fewer heads: pad to (layers, config heads, T, T) with NaN for the missing.
    T = len(ids)
    att = torch.full((cfg.num_hidden_layers, cfg.num_attention_heads, T, T), float("nan"))
    for layer, a in enumerate(att_layers):
        att[layer, heads[layer]] = a

    q2t, t2q = cross_mass(att, layout)
    layers = []
    for layer in range(cfg.num_hidden_layers):
        cls_rows = _round(att[layer, heads[layer], 0], SUMMARY_DECIMALS)
        layers.append(
            {
                "layer": layer,
                "heads": [
                    {
                        "head": h,
                        "cls": cls_rows[k],
                        "query_to_title": round(float(q2t[layer, h]), SUMMARY_DECIMALS),
                        "title_to_query": round(float(t2q[layer, h]), SUMMARY_DECIMALS),
                    }
                    for k, h in enumerate(heads[layer])
                ],
            }
        )

    matching = []
    tm = term_matching(att, ids, layout)
    if tm is not None:
        mq, mt = tm
        score = (mq + mt) / 2
        kept = [(layer, h) for layer in range(cfg.num_hidden_layers) for h in heads[layer]]
        kept.sort(key=lambda lh: -float(score[lh]))
        matching = [
            {
                "layer": layer,
                "head": h,
                "score": round(float(score[layer, h]), SUMMARY_DECIMALS),
                "query_to_title": round(float(mq[layer, h]), SUMMARY_DECIMALS),
                "title_to_query": round(float(mt[layer, h]), SUMMARY_DECIMALS),
            }
            for layer, h in kept[: max(0, top_heads)]
        ]

    attribution, replacement = occlusion(model, ids, seg, layout)
    out = {
        "model": model.name,
        "labels": list(model.labels),
        "level": model.labels[int(scored.level[0])],
        "score": round(float(scored.expected[0]), SUMMARY_DECIMALS),
        "probs": dict(zip(model.labels, _round(probs, SUMMARY_DECIMALS))),
        "truncated": enc.truncated[0],
        "tokens": [
            {"token": tok, "segment": s, "special": layout.special(i)}
            for i, (tok, s) in enumerate(zip(model.tokenizer.tokens(ids), seg))
        ],
        "layers": layers,
        "term_matching_heads": matching,
        "occlusion": {"replacement": replacement, "attribution": attribution},
    }
    if attention:
        # heads absent after pruning come out as null rows
        out["attention"] = [
            [
                _round(att[layer, h], MATRIX_DECIMALS) if h in heads[layer] else None
                for h in range(cfg.num_attention_heads)
            ]
            for layer in range(cfg.num_hidden_layers)
        ]
    return out
