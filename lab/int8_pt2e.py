"""The fused int8 path torch has (issue 20): PT2E static int8 through inductor, speed and grade.

torchao's `X86InductorQuantizer` (default config: static per-tensor u8 activations, per-channel s8 weights),
`prepare_pt2e` -> calibrate on `--calibration-pairs` train pairs -> `convert_pt2e` -> `torch.compile` with
inductor's freezing, which lowers the linears to `onednn::qlinear_pointwise` and fuses the quantisation into
the ops that produce their inputs.
  - speed: the shipped model's encoder layers on one padded (B, T) batch (mask all ones), against bf16 eager
    with the shipped oneDNN linears and bf16 under inductor, interleaved, median of `--repeats`;
  - grade: the whole model exported with dynamic batch and length, compiled, on `--quality-pairs` dev pairs in
    length-sorted batches of 32, against qtrel float32: same level and score RMSE (post-training quantisation).
Needs torchao and a C++ compiler (inductor). Prints its results; `docs/benchmarks.md` has the run it quotes.

  python lab/int8_pt2e.py [--shapes 32x32 8x32] [--quality-pairs 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import statistics
import time
import warnings

import torch
import torch._inductor.config as inductor_config
from anchors import isa, isa_line
from int8_tradeoff import read_pairs
from results import DEV
from torch import Tensor, nn

from model.bert import Layer
from model.engines.kernels import use_onednn_linears
from model.relevance import RelevanceModel, pad_batch

TRAIN = DEV.parent / "train.csv"


class Layers(nn.Module):
    """The encoder layers alone: (B, T, H) hidden states and a (B, 1, 1, T) additive bias -> (B, T, H)."""

    def __init__(self, layers: list[Layer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        for layer in self.layers:
            x, _ = layer(x, bias, None, False)
        return x


class Logits(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids: Tensor, seg: Tensor, mask: Tensor) -> Tensor:
        return self.m(ids, seg, mask)[0]


def quantised(module: nn.Module, example: tuple, calibration: list[tuple], dynamic=None):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    q = xiq.X86InductorQuantizer()
    q.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(module, example, dynamic_shapes=dynamic).module(), q)
    for args in calibration:
        prepared(*args)
    return convert_pt2e(prepared)


def padded_batches(m: RelevanceModel, pairs: list[tuple[str, str]], size: int = 32):
    enc = m.encode(pairs)
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    for i in range(0, len(order), size):
        c = order[i : i + size]
        yield c, pad_batch([enc.input_ids[j] for j in c], [enc.token_type_ids[j] for j in c], m.tokenizer.pad_id)


def speed(plain: RelevanceModel, b: int, t: int, repeats: int) -> dict[str, float]:
    layers = [m for m in plain.module.modules() if isinstance(m, Layer)]
    fp = Layers(copy.deepcopy(layers)).eval()
    g = torch.Generator().manual_seed(0)
    ln = lambda: torch.nn.functional.layer_norm(torch.randn(b, t, 384, generator=g), (384,))  # noqa: E731
    x, bias = ln(), torch.zeros(b, 1, 1, t)
    bf = Layers(copy.deepcopy(layers)).eval().to(torch.bfloat16)
    use_onednn_linears(bf)
    systems = {
        "bf16 eager, shipped oneDNN linears": (bf, (x.bfloat16(), bias.bfloat16())),
        "bf16 inductor": (torch.compile(copy.deepcopy(fp).to(torch.bfloat16)), (x.bfloat16(), bias.bfloat16())),
        "int8 PT2E static, inductor": (
            torch.compile(quantised(fp, (x, bias), [(ln(), bias) for _ in range(8)])),
            (x, bias),
        ),
    }
    ms: dict[str, list[float]] = {k: [] for k in systems}
    names = list(systems)
    with torch.no_grad():
        for fn, args in systems.values():
            fn(*args)  # compile / warm up
        for r in range(repeats):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                fn, args = systems[k]
                ts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    fn(*args)
                    ts.append(time.perf_counter() - t0)
                ms[k].append(statistics.median(ts) * 1e3)
    base = ms[names[0]]
    print(f"speed, {b} x {t} = {b * t} token rows, 1-minute load {os.getloadavg()[0]:.2f}:")
    for k, v in ms.items():
        ratio = statistics.median(a / c for a, c in zip(base, v))
        print(f"  {k}: {statistics.median(v):.1f} ms ({min(v):.1f}–{max(v):.1f}), × bf16 eager {ratio:.2f}")
    return {k: statistics.median(v) for k, v in ms.items()}


def quality(ref: RelevanceModel, plain: RelevanceModel, n_dev: int, n_cal: int) -> None:
    with open(TRAIN, encoding="utf-8") as f:
        cal = [(r["query"], r["title"]) for _, r in zip(range(n_cal), csv.DictReader(f))]
    dev = read_pairs(n_dev)
    _, example = next(padded_batches(plain, dev))
    dim_b, dim_t = torch.export.Dim("B", min=2, max=256), torch.export.Dim("T", min=2, max=512)
    dims = ({0: dim_b, 1: dim_t},) * 3
    with torch.no_grad():
        calibration = [args for _, args in padded_batches(plain, cal)]
        qm = torch.compile(quantised(Logits(plain.module.eval()), example, calibration, dims), dynamic=True)
        got = torch.empty(len(dev), len(ref.labels))
        for c, args in padded_batches(plain, dev):
            got[c] = qm(*args).float()
    want, have = ref.score(ref.encoded_logits(ref.encode(dev))), ref.score(got)
    d = have.expected - want.expected
    print(
        f"grade, {n_dev} dev pairs against qtrel float32 ({n_cal} calibration pairs), compiled: same level "
        f"{(have.level == want.level).float().mean().item():.2%}, score RMSE {d.pow(2).mean().sqrt().item():.4f}, "
        f"1-minute load {os.getloadavg()[0]:.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="model/default")
    ap.add_argument("--shapes", nargs="*", default=["32x32", "8x32"], help="padded batches BxT for the speed test")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quality-pairs", type=int, default=2000, help="0 skips the grade")
    ap.add_argument("--calibration-pairs", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    inductor_config.freezing = True
    print(isa_line(isa()), f"; torch {torch.__version__}, 1 thread", flush=True)
    ref = RelevanceModel.load(args.model, dtype="float32")
    plain = RelevanceModel.load(args.model, dtype="float32", onednn=False)
    for shape in args.shapes:
        b, t = (int(v) for v in shape.split("x"))
        speed(plain, b, t, args.repeats)
    if args.quality_pairs:
        quality(ref, plain, args.quality_pairs, args.calibration_pairs)
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # torchao's CUDA-extension and deprecation notices
    raise SystemExit(main())
