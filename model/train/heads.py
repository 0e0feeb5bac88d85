"""Attention-head analysis and pruning, after the query-title BERT study (HEAD-MASK experiments).

Every experiment masks heads (a masked head emits a zero vector for every input) on a trained model,
without retraining, and reports the `qtrel eval` metrics relative to the unmasked model. Pruning then
removes the least important heads for real, shrinking the q/k/v and output projections.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from model.bert import BertForRelevance
from model.data import Dataset
from model.levels import MAX_BATCH_TOKENS
from model.relevance import RelevanceModel, length_batches, pad_batch
from model.train.evaluate import metrics_of

HEADLINE = ("accuracy", "macro_f1", "qwk", "ndcg@10", "rmse_level")


class HeadEvaluator:
    """Evaluates one model under many head masks on one labelled set, tokenising it once."""

    def __init__(self, model: RelevanceModel, ds: Dataset, max_batch_tokens: int = MAX_BATCH_TOKENS):
        self.model = model
        self.ds = ds
        self.enc = model.encode(ds.pairs)
        self.max_batch_tokens = max_batch_tokens
        cfg = model.cfg
        self.layers, self.heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.base = self.metrics(None)

    def ones(self) -> Tensor:
        return torch.ones(self.layers, self.heads)

    def metrics(self, head_mask: Tensor | None) -> dict:
        m = metrics_of(self.ds, self.model.score(self.model.encoded_logits(self.enc, self.max_batch_tokens, head_mask)))
        return {key: m[key] for key in (*HEADLINE, "rmse_relevance") if key in m}

    def relative(self, head_mask: Tensor | None) -> dict:
        """Metrics under the mask, and their change relative to the unmasked model."""
        m = self.metrics(head_mask)
        rel = {k: (m[k] - self.base[k]) / self.base[k] if self.base[k] else 0.0 for k in m}
        return {"metrics": m, "relative_change": rel}


def mask_of(layers: int, heads: int, off: list[tuple[int, int]]) -> Tensor:
    m = torch.ones(layers, heads)
    for layer, head in off:
        m[layer, head] = 0
    return m


def all_heads(layers: int, heads: int) -> list[tuple[int, int]]:
    return [(la, h) for la in range(layers) for h in range(heads)]


# --- experiments ------------------------------------------------------------------------------
def random_masking(ev: HeadEvaluator, fractions=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5), seeds=(0, 1, 2), tick=None) -> dict:
    pool = all_heads(ev.layers, ev.heads)
    out = []
    for f in fractions:
        runs = []
        for s in seeds:
            off = random.Random(s).sample(pool, round(f * len(pool)))
            runs.append(ev.relative(mask_of(ev.layers, ev.heads, off)))
            tick and tick()
        out.append({"fraction": f, "runs": runs, **_spread(runs)})
    return {"experiment": "random", "base": ev.base, "points": out}


def lower_vs_upper(ev: HeadEvaluator, fractions=(0.2, 0.4, 0.6, 0.8, 1.0), seeds=(0, 1, 2), tick=None) -> dict:
    half = ev.layers // 2
    groups = {"lower": range(0, half), "upper": range(half, ev.layers)}
    out: dict[str, list] = {}
    for name, layers in groups.items():
        pool = [(la, h) for la in layers for h in range(ev.heads)]
        pts = []
        for f in fractions:
            runs = []
            for s in seeds if f < 1.0 else seeds[:1]:
                off = random.Random(s).sample(pool, round(f * len(pool)))
                runs.append(ev.relative(mask_of(ev.layers, ev.heads, off)))
                tick and tick()
            pts.append({"fraction": f, "runs": runs, **_spread(runs)})
        out[name] = pts
    return {
        "experiment": "lower_vs_upper",
        "lower_layers": list(groups["lower"]),
        "upper_layers": list(groups["upper"]),
        "base": ev.base,
        "points": out,
    }


def whole_layers(ev: HeadEvaluator, tick=None) -> dict:
    out = []
    for la in range(ev.layers):
        out.append({"layer": la, **ev.relative(mask_of(ev.layers, ev.heads, [(la, h) for h in range(ev.heads)]))})
        tick and tick()
    return {"experiment": "whole_layers", "base": ev.base, "points": out}


def single_heads(ev: HeadEvaluator, tick=None) -> dict:
    grid = {k: [[0.0] * ev.heads for _ in range(ev.layers)] for k in ev.base}
    for la, h in all_heads(ev.layers, ev.heads):
        r = ev.relative(mask_of(ev.layers, ev.heads, [(la, h)]))
        for k, v in r["relative_change"].items():
            grid[k][la][h] = v
        tick and tick()
    return {"experiment": "single_heads", "base": ev.base, "relative_change": grid}


@torch.inference_mode()
def term_matching_scores(model: RelevanceModel, ds: Dataset, max_pairs: int = 500) -> list[list[float]]:
    """Per head, the attention mass between identical tokens of query and title: for each query token
    that also occurs in the title, its attention to those identical title tokens (and symmetrically),
    averaged over such tokens and pairs. (layers, heads)."""
    tok = model.tokenizer
    if not isinstance(model.module, BertForRelevance):
        raise ValueError(f"head studies run BERT-shaped encoders, not {model.cfg.model_type}")
    enc = model.encode(ds.pairs[:max_pairs])
    special = {tok.cls_id, tok.sep_id, tok.pad_id}
    cfg = model.cfg
    total = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads)
    count = 0
    for b in length_batches(enc.lengths, 4096):
        ids, seg, mask = pad_batch([enc.input_ids[i] for i in b], [enc.token_type_ids[i] for i in b], tok.pad_id)
        _, att = model.module(ids.to(model.device), seg.to(model.device), mask.to(model.device), output_attentions=True)
        for row, i in enumerate(b):
            x, s = enc.input_ids[i], enc.token_type_ids[i]
            q = [p for p in range(len(x)) if s[p] == 0 and x[p] not in special]
            t = [p for p in range(len(x)) if s[p] == 1 and x[p] not in special]
            pairs = [(p, r) for p in q for r in t if x[p] == x[r]]
            if not pairs:
                continue
            src = torch.tensor([p for p, _ in pairs] + [r for _, r in pairs])
            dst = torch.tensor([r for _, r in pairs] + [p for p, _ in pairs])
            n_src = len(set(src.tolist()))
            for la, a in enumerate(att):  # a: (B, nh, T, T), nh = heads kept in this layer
                mass = a[row][:, src, dst].float().sum(-1) / n_src  # (nh,)
                heads = model.module.bert.blocks[la].attn.heads
                total[la, heads] += mass.cpu()
            count += 1
    return (total / max(count, 1)).tolist()


def term_matching(ev: HeadEvaluator, ks=(1, 2, 3, 5, 8), seeds=(0, 1, 2), max_pairs: int = 500, tick=None) -> dict:
    scores = term_matching_scores(ev.model, ev.ds, max_pairs)
    ranked = sorted(all_heads(ev.layers, ev.heads), key=lambda lh: -scores[lh[0]][lh[1]])
    pool = all_heads(ev.layers, ev.heads)
    pts = []
    for k in ks:
        top = ev.relative(mask_of(ev.layers, ev.heads, ranked[:k]))
        rand = [ev.relative(mask_of(ev.layers, ev.heads, random.Random(s).sample(pool, k))) for s in seeds]
        tick and tick()
        pts.append({"k": k, "top_heads": ranked[:k], "top": top, "random": _spread(rand)})
    return {
        "experiment": "term_matching",
        "base": ev.base,
        "scores": scores,
        "ranking": [list(x) for x in ranked[:16]],
        "points": pts,
    }


def _spread(runs: list[dict]) -> dict:
    keys = runs[0]["relative_change"].keys()
    mean = {k: sum(r["relative_change"][k] for r in runs) / len(runs) for k in keys}
    std = {k: (sum((r["relative_change"][k] - mean[k]) ** 2 for r in runs) / len(runs)) ** 0.5 for k in keys}
    return {"mean_relative_change": mean, "std_relative_change": std}


# --- importance and pruning ---------------------------------------------------------------------
def gradient_importance(
    module: BertForRelevance, enc, labels: list[int], pad_id: int = 0, max_batch_tokens: int = 4096
) -> Tensor:
    """|dL/d mask| per head summed over the data (Michel et al., 2019): how much the loss depends on
    each head. (layers, config heads); pruned heads get 0."""
    cfg = module.cfg
    mask = torch.ones(cfg.num_hidden_layers, cfg.num_attention_heads, requires_grad=True)
    imp = torch.zeros_like(mask)
    was_training = module.training
    module.eval()
    y = torch.tensor(labels)
    for b in length_batches(enc.lengths, max_batch_tokens):
        ids, seg, att = pad_batch([enc.input_ids[i] for i in b], [enc.token_type_ids[i] for i in b], pad_id)
        logits, _ = module(ids, seg, att, head_mask=mask)
        loss = nn.functional.cross_entropy(logits.float(), y[b], reduction="sum")
        (g,) = torch.autograd.grad(loss, mask)
        imp += g.abs()
    module.train(was_training)
    for la, layer in enumerate(module.bert.blocks):
        gone = [h for h in range(cfg.num_attention_heads) if h not in layer.attn.heads]
        imp[la, gone] = 0
    return imp.detach()


def prune_order(importance: Tensor, module: BertForRelevance) -> list[tuple[int, int]]:
    """Present heads from least to most important (layer-normalised importance, as in Michel et al.)."""
    norm = importance / importance.norm(dim=1, keepdim=True).clamp_min(1e-12)
    present = [(la, h) for la, layer in enumerate(module.bert.blocks) for h in layer.attn.heads]
    return sorted(present, key=lambda lh: norm[lh[0], lh[1]].item())


def heads_to_remove(order: list[tuple[int, int]], module: BertForRelevance, n: int) -> list[tuple[int, int]]:
    """The first `n` heads of `order` (least important first) that leave at least one head per layer."""
    left = {la: len(layer.attn.heads) for la, layer in enumerate(module.bert.blocks)}
    out: list[tuple[int, int]] = []
    for la, h in order:
        if len(out) == n:
            break
        if left[la] > 1:
            out.append((la, h))
            left[la] -= 1
    return out


@torch.no_grad()
def prune_heads(module: BertForRelevance, remove: list[tuple[int, int]]) -> BertForRelevance:
    """A new, smaller module without the heads in `remove` (original indices). At least one head is
    kept in every layer. The config records the cumulative `pruned_heads`."""
    cfg = module.cfg
    pruned = {la: set(v) for la, v in cfg.pruned_heads.items()}
    for la, h in remove:
        pruned.setdefault(la, set()).add(h)
    for la, gone in pruned.items():
        if len(gone) >= cfg.num_attention_heads:
            raise ValueError(f"cannot remove every head of layer {la}")
    new_cfg = replace(cfg, pruned_heads={la: sorted(v) for la, v in pruned.items() if v})
    new = BertForRelevance(new_cfg, with_pooler=module.bert.pooler is not None)
    src = module.state_dict()
    hs = cfg.head_size
    for key, value in new.state_dict().items():
        old = src[key]
        if old.shape == value.shape:
            value.copy_(old)
            continue
        la = int(key.split(".")[2])  # bert.layers.{i}.attn...
        old_heads = module.bert.blocks[la].attn.heads
        keep = [old_heads.index(h) for h in new.bert.blocks[la].attn.heads]
        idx = torch.cat([torch.arange(p * hs, (p + 1) * hs) for p in keep])
        if ".attn.out.weight" in key:
            value.copy_(old[:, idx])
        else:  # query/key/value weight rows and biases
            value.copy_(old[idx])
    return new


def prune_checkpoint(
    model_dir: str | Path, data_file: str | Path, out: str | Path, fraction: float, limit: int = 2000
) -> dict:
    """`qtrel prune`: remove `fraction` of all heads, least important first by gradient importance on the
    first `limit` pairs of `data_file` (use training data), keeping a head in every layer; save to `out`."""
    from model.checkpoint import load_module, save_checkpoint
    from model.data import read_labelled
    from model.tokenizer import PairTokenizer

    if not 0 <= fraction < 1:
        raise ValueError(f"--fraction must be in [0, 1), got {fraction}")
    module = load_module(model_dir)
    tok = PairTokenizer.from_dir(model_dir)
    ds = read_labelled(data_file, module.cfg.levels)
    ds.examples = ds.examples[:limit]
    enc = tok.encode([e.query for e in ds.examples], [e.title for e in ds.examples])
    order = prune_order(gradient_importance(module, enc, ds.labels, tok.pad_id), module)
    n = round(fraction * module.cfg.num_hidden_layers * module.cfg.num_attention_heads)
    remove = heads_to_remove(order, module, n)
    pruned = prune_heads(module, remove)
    save_checkpoint(pruned, tok, out)
    return {
        "removed": len(remove),
        "pruned_heads": {str(k): v for k, v in pruned.cfg.pruned_heads.items()},
        "out": str(out),
    }
