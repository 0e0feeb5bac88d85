"""Fine-tune a k-level head on an encoder whose tokenizer.json frames pairs itself (XLM-R's
`<s> q </s></s> t </s>`, one segment id): how builtin:zh was made from the trimmed multilingual-e5-small.

    python -m model.train.finetune_zh ENCODER DATA OUT --epochs 3 --freeze 4 --world 2 --rank R

DATA holds train.jsonl and heldout.jsonl (model.train.qbqtc). Each `--evals` fraction of an epoch the model
is scored on heldout.jsonl; the best macro-F1 is saved to OUT as a float32 checkpoint with its metrics.
The embeddings and the `--freeze` bottom layers stay fixed: their outputs are computed once. Length-bucketed
batches, bfloat16 autocast, AdamW with linear warm-up and decay, cross-entropy weighted by a power of each
class's inverse frequency (`--class-weight-power`; QBQTC's levels 1:2:3 are 2.2:3.6:1: unweighted, the head
rarely says 3 and macro-F1 suffers). `--world` processes train data-parallel, one thread each (gloo).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from model.bert import BertForRelevance
from model.checkpoint import load_module, ours_to_hf
from model.train.metrics import accuracy, confusion, macro_f1
from model.train.qbqtc import LEVELS, read

log = logging.getLogger("qtrel.finetune_zh")


class Framer:
    """`<s> query </s></s> title </s>`, segment 0 throughout, the title cut to fit (the query kept whole up to
    half the length): the frame model.tokenizer builds from this tokenizer.json's post-processor."""

    def __init__(self, path: Path, max_length: int):
        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tok.no_truncation()
        ids = [self.tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")]
        if None in ids:
            raise ValueError(f"{path}/tokenizer.json lacks <s>, </s> or <pad>")
        self.bos, self.eos, self.pad = (int(i) for i in ids)  # type: ignore[arg-type]  # None ruled out above
        self.max_length = max_length

    def encode(self, queries: list[str], titles: list[str]) -> list[list[int]]:
        qs = self.tok.encode_batch(queries, add_special_tokens=False)
        ts = self.tok.encode_batch(titles, add_special_tokens=False)
        budget = self.max_length - 4
        out = []
        for q, t in zip(qs, ts):
            qi = q.ids[: budget // 2] if len(q.ids) + 1 > budget else q.ids
            ti = t.ids[: budget - len(qi)]
            out.append([self.bos, *qi, self.eos, self.eos, *ti, self.eos])
        return out


def batches(lengths: list[int], size: int, rng: random.Random) -> list[list[int]]:
    order = list(range(len(lengths)))
    rng.shuffle(order)
    out = []
    for s in range(0, len(order), size * 50):  # sort within windows of 50 batches: little padding
        chunk = sorted(order[s : s + size * 50], key=lengths.__getitem__)
        out += [chunk[i : i + size] for i in range(0, len(chunk), size)]
    rng.shuffle(out)
    return out


def pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(map(len, rows))
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def new_model(encoder: Path, levels: tuple[str, ...], seed: int) -> BertForRelevance:
    enc = load_module(encoder, num_labels_fallback=True)
    module = BertForRelevance(enc.cfg.with_labels(list(levels)), with_pooler=True)
    module.init_weights(seed)
    src = enc.state_dict()
    with torch.no_grad():
        for k, v in module.state_dict().items():
            if k in src and not k.startswith("classifier."):
                v.copy_(src[k])
    return module


@torch.no_grad()
def bottom(module: BertForRelevance, rows: list[list[int]], pad_id: int, frozen: int, size: int = 64) -> list[Tensor]:
    """Each pair's hidden states after the embeddings and the first `frozen` layers (bfloat16, unpadded):
    computed once, since those layers do not train."""
    module.eval()
    enc = module.bert
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out: list[Tensor] = [torch.empty(0)] * len(rows)
    for s in range(0, len(order), size):
        idx = order[s : s + size]
        ids, mask = pad([rows[i] for i in idx], pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = enc.embeddings(ids, torch.zeros_like(ids))
            bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            for layer in enc.blocks[:frozen]:
                x, _ = layer(x, bias, None, False)
        for j, i in enumerate(idx):
            out[i] = x[j, : len(rows[i])].to(torch.bfloat16).clone()
    module.train()
    return out


def top(module: BertForRelevance, xs: list[Tensor], frozen: int) -> Tensor:
    """Logits from cached `bottom` states through the layers that train, the pooler and the head."""
    n = max(len(x) for x in xs)
    x = torch.zeros(len(xs), n, xs[0].shape[-1], dtype=torch.bfloat16)
    mask = torch.zeros(len(xs), n)
    for i, h in enumerate(xs):
        x[i, : len(h)], mask[i, : len(h)] = h, 1
    enc = module.bert
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bias = (1.0 - mask[:, None, None, :]) * torch.finfo(torch.float32).min
        for layer in enc.blocks[frozen:]:
            x, _ = layer(x, bias, None, False)
        cls = enc.pooler(x) if enc.pooler is not None else x[:, 0]
        return module.classifier(module.dropout(cls))


@torch.no_grad()
def predict(module: BertForRelevance, xs: list[Tensor], frozen: int, size: int = 64) -> list[int]:
    module.eval()
    order = sorted(range(len(xs)), key=lambda i: len(xs[i]))
    pred = [0] * len(xs)
    for s in range(0, len(order), size):
        idx = order[s : s + size]
        logits = top(module, [xs[i] for i in idx], frozen)
        for i, p in zip(idx, logits.float().argmax(-1).tolist()):
            pred[i] = p
    module.train()
    return pred


def report(y: list[int], pred: list[int], k: int) -> dict:
    return {
        "accuracy": round(accuracy(y, pred), 4),
        "macro_f1": round(macro_f1(y, pred, k), 4),
        "confusion": confusion(y, pred, k),
    }


def save(module: BertForRelevance, path: Path, metrics: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in ours_to_hf(module.state_dict()).items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(module.cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    (path / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")


def _all_reduce_grads(params: list[Tensor], world: int) -> None:
    """Average the gradients over the ranks, in one flat buffer."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    i = 0
    for p, g in zip(params, grads):
        p.grad = flat[i : i + g.numel()].view_as(g)
        i += g.numel()


def _gather(values: list, world: int) -> list:
    import torch.distributed as dist

    if world == 1:
        return values
    out: list = [None] * world
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def train(a: argparse.Namespace) -> dict:
    """Data-parallel over `a.world` single-thread processes (gloo): on a loaded host, each process gets its
    share of the CPU, where one process's two threads wait on each other."""
    import torch.distributed as dist

    rank, world = a.rank, a.world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    rng = random.Random(a.seed * 100 + rank)
    framer = Framer(a.encoder, a.max_length)
    tr, ho = read(a.data / "train.jsonl"), read(a.data / "heldout.jsonl")
    if a.limit:
        tr, ho = tr[: a.limit], ho[: a.limit // 4]
    n_train, n_ho = len(tr), len(ho)
    y_all = torch.tensor([p["label"] for p in tr])
    tr, ho = tr[rank::world], ho[rank::world]  # this rank's shard
    x_tr = framer.encode([p["query"] for p in tr], [p["title"] for p in tr])
    y_tr = torch.tensor([p["label"] for p in tr])
    x_ho, y_ho = framer.encode([p["query"] for p in ho], [p["title"] for p in ho]), [p["label"] for p in ho]
    k = len(LEVELS)
    freq = torch.bincount(y_all, minlength=k).float()
    weight = (freq.sum() / freq) ** a.class_weight_power
    weight = weight / (weight * freq).sum() * freq.sum()  # mean weight over the examples is 1
    module = new_model(a.encoder, LEVELS, a.seed).train()
    t0 = time.time()
    h_tr, h_ho = bottom(module, x_tr, framer.pad, a.freeze), bottom(module, x_ho, framer.pad, a.freeze)
    log.info("rank %d: embeddings and %d frozen layers computed once in %.0f s", rank, a.freeze, time.time() - t0)
    frozen = {"bert.embeddings."} | {f"bert.layers.{i}." for i in range(a.freeze)}
    params = [(n, p) for n, p in module.named_parameters() if not any(n.startswith(f) for f in frozen)]
    for n, p in module.named_parameters():
        p.requires_grad_(not any(n.startswith(f) for f in frozen))
    no_decay = [p for n, p in params if n.endswith("bias") or "norm" in n]
    decay = [p for n, p in params if not (n.endswith("bias") or "norm" in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=a.lr
    )
    local_batch = a.batch_size // world
    per_epoch = n_train // world // local_batch  # the same on every rank
    total, warm = per_epoch * a.epochs, int(0.06 * per_epoch * a.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm))
    )
    lengths = [len(r) for r in x_tr]
    eval_every = max(1, per_epoch // a.evals)
    best: dict = {"macro_f1": -1.0}
    step, t0, seen = 0, time.time(), 0
    log.info(
        "train %d pairs, held out %d, %d ranks; %d steps/epoch, class weights %s",
        n_train,
        n_ho,
        world,
        per_epoch,
        weight.tolist(),
    )
    for epoch in range(a.epochs):
        for b in batches(lengths, local_batch, rng)[:per_epoch]:
            logits = top(module, [h_tr[i] for i in b], a.freeze)
            loss = F.cross_entropy(logits.float(), y_tr[b], weight=weight)
            loss.backward()
            if world > 1:
                _all_reduce_grads([p for _, p in params], world)
            torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step, seen = step + 1, seen + len(b) * world
            if step % 20 == 0 and rank == 0:
                log.info(
                    "epoch %d step %d/%d loss %.4f  %.1f pairs/s",
                    epoch,
                    step,
                    total,
                    loss.item(),
                    seen / (time.time() - t0),
                )
            if step % eval_every == 0 or step == total:
                y = _gather(y_ho, world)
                pred = _gather(predict(module, h_ho, a.freeze), world)
                m = report(y, pred, k) | {"epoch": epoch, "step": step}
                if rank == 0:
                    log.info("held out: %s", json.dumps(m))
                if m["macro_f1"] > best["macro_f1"]:
                    best = m
                    if rank == 0:
                        info = {"train_pairs": n_train, "heldout_pairs": n_ho}
                        save(module, a.out, m | info | {"args": {k_: str(v) for k_, v in vars(a).items()}})
                        log.info("saved best to %s", a.out)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("encoder", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--evals", type=int, default=2, help="held-out evaluations per epoch")
    ap.add_argument("--threads", type=int, default=1, help="1: on a loaded 2-core host, 2 threads ran 4x slower")
    ap.add_argument("--freeze", type=int, default=6, help="embeddings and this many bottom layers stay fixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--class-weight-power", type=float, default=0.5, help="class weights: 1/frequency to this power")
    ap.add_argument("--world", type=int, default=1, help="data-parallel processes (start one per --rank)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=18700, help="the ranks' rendezvous port on 127.0.0.1")
    ap.add_argument("--limit", type=int, default=0, help="train on the first N pairs only (a smoke run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(json.dumps(train(args)))


if __name__ == "__main__":
    main()
