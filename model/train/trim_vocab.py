"""Trim a Unigram (SentencePiece) checkpoint's vocabulary to the pieces a corpus and a character set need.

multilingual-e5-small keeps 250,037 embedding rows (96 MB in float16, three quarters of the model) for
~100 languages. For Chinese and English search text a tenth of them serves: every piece the given texts
use (so those texts tokenise exactly as before: the Viterbi best segmentation over the full vocabulary
uses only kept pieces, and removing pieces never adds a path), every single character of the CJK, Latin
and punctuation blocks below (a text outside the corpus still reads character by character rather than
as <unk>), then the most frequent remaining pieces of those scripts up to `max_rows`.

    python -m model.train.trim_vocab SRC OUT --exact QBQTC.json... --ranked HOMEDEPOT.csv...
    python -m model.train.trim_vocab SRC OUT --exact HOMEDEPOT.csv... --scripts latin --max-rows 30522

`--scripts latin` keeps the Latin and punctuation blocks only (an English model: no CJK rows to train).

Ids keep their order (the specials stay first); `tokenizer.json`'s vocab list, its added tokens and the
embedding rows are remapped together.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# Unicode blocks whose single characters are kept: Basic Latin .. Latin Extended-B, general punctuation,
# CJK symbols and punctuation, CJK unified ideographs, full-width forms
BLOCKS = [(0x20, 0x24F), (0x2000, 0x206F), (0x3000, 0x303F), (0x4E00, 0x9FFF), (0xFF00, 0xFFEF)]
SCRIPTS = {"latin+cjk": BLOCKS, "latin": [(0x20, 0x24F), (0x2000, 0x206F)]}
META = "\u2581"  # SentencePiece's word-start marker
# 26,800 rows x 384 in float16 (20.6 MB) + the 12-layer encoder and head (43.3 MB) stay under 64 MB
MAX_ROWS = 26_800


def in_blocks(piece: str, blocks: list[tuple[int, int]] = BLOCKS) -> bool:
    chars = piece.replace(META, "")
    return bool(chars) and all(any(lo <= ord(c) <= hi for lo, hi in blocks) for c in chars)


def corpus_texts(paths: Iterable[Path]) -> list[str]:
    """Queries and titles of JSON-lines (QBQTC) or CSV (Home Depot) files, each once."""
    texts: list[str] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()] if p.suffix == ".json" else list(csv.DictReader(f))
        for r in rows:
            texts += [r["query"], r["title"]]
    return list(dict.fromkeys(texts))


def choose_pieces(
    tokenizer_json: dict, exact: list[str], ranked: list[str], max_rows: int, blocks: list[tuple[int, int]] = BLOCKS
) -> list[int]:
    """Old ids to keep, ascending: specials, every piece of the `exact` texts, single characters of BLOCKS,
    then the pieces of the `ranked` texts, most used first, then the remaining pieces of BLOCKS in id
    order (SentencePiece orders by score), up to `max_rows`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(tokenizer_json))
    vocab = tokenizer_json["model"]["vocab"]
    keep = {t["id"] for t in tokenizer_json["added_tokens"]} | {tokenizer_json["model"]["unk_id"]}
    keep |= {i for e in tok.encode_batch(exact, add_special_tokens=False) for i in e.ids}
    keep |= {i for i, (p, _) in enumerate(vocab) if len(p.replace(META, "")) == 1 and in_blocks(p, blocks)}
    if len(keep) > max_rows:
        raise ValueError(f"the exact corpus and the character set need {len(keep)} pieces, over max_rows {max_rows}")
    used = Counter(i for e in tok.encode_batch(ranked, add_special_tokens=False) for i in e.ids)
    by_id = (i for i, (p, _) in enumerate(vocab) if in_blocks(p, blocks))
    for i in [i for i, _ in used.most_common()] + list(by_id):
        if len(keep) >= max_rows:
            break
        keep.add(i)
    return sorted(keep)


def trimmed_tokenizer(tokenizer_json: dict, keep: list[int]) -> dict:
    new_id = {old: new for new, old in enumerate(keep)}
    out = json.loads(json.dumps(tokenizer_json))
    out["model"]["vocab"] = [tokenizer_json["model"]["vocab"][i] for i in keep]
    out["model"]["unk_id"] = new_id[tokenizer_json["model"]["unk_id"]]
    for t in out["added_tokens"]:
        t["id"] = new_id[t["id"]]
    post = out.get("post_processor") or {}
    for spec in (post.get("special_tokens") or {}).values():
        spec["ids"] = [new_id[i] for i in spec["ids"]]
    return out


def trim(
    src: Path, out: Path, exact: list[Path], ranked: list[Path], max_rows: int, scripts: str = "latin+cjk"
) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    texts, others = corpus_texts(exact), corpus_texts(ranked)
    keep = choose_pieces(spec, texts, others, max_rows, SCRIPTS[scripts])
    new_spec = trimmed_tokenizer(spec, keep)
    state = load_file(str(src / "model.safetensors"))
    key = next(k for k in state if k.endswith("word_embeddings.weight"))
    state[key] = state[key][torch.tensor(keep)].contiguous()
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config["vocab_size"] = len(keep)
    config["pad_token_id"] = keep.index(config.get("pad_token_id", 1))
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(json.dumps(new_spec, ensure_ascii=False), encoding="utf-8")
    # The corpus must tokenise exactly as before, id for id through the map.
    full, small = Tokenizer.from_str(json.dumps(spec)), Tokenizer.from_file(str(out / "tokenizer.json"))
    a = full.encode_batch(texts, add_special_tokens=False)
    b = small.encode_batch(texts, add_special_tokens=False)
    differ = sum([keep[i] for i in y.ids] != x.ids for x, y in zip(a, b))
    if differ:
        raise SystemExit(f"{differ} of {len(texts)} exact-corpus texts tokenise differently after trimming")
    a = full.encode_batch(others, add_special_tokens=False)
    b = small.encode_batch(others, add_special_tokens=False)
    same = sum([keep[i] for i in y.ids] == x.ids for x, y in zip(a, b))
    return {
        "out": str(out),
        "rows": len(keep),
        "exact_texts_identical": len(texts),
        "ranked_texts": len(others),
        "ranked_texts_identical": same,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a converted encoder (model.train.convert_e5)")
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--exact",
        type=Path,
        nargs="+",
        required=True,
        help="JSON-lines or CSV files of query/title whose every piece is kept (checked)",
    )
    ap.add_argument(
        "--ranked", type=Path, nargs="*", default=[], help="files whose pieces fill the rows left, most used first"
    )
    ap.add_argument("--max-rows", type=int, default=MAX_ROWS)
    ap.add_argument("--scripts", choices=sorted(SCRIPTS), default="latin+cjk", help="whose single characters stay")
    args = ap.parse_args(argv)
    print(json.dumps(trim(args.src, args.out, args.exact, args.ranked, args.max_rows, args.scripts)))


if __name__ == "__main__":
    main()
