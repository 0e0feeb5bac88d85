"""Static int8 for the OpenVINO forward: a plan, calibrated on training pairs and stored with the checkpoint.

Issue 20 measured the int8 that torch offers (dynamic quantisation, per-token `_int_mm`): either the grade moves
(83% of levels kept) or the speed does not (0.8-1.1x bfloat16), because quantising the activations at run time
costs what the int8 kernels save. Static int8 fixes each activation's range in advance, so OpenVINO folds the
quantisation into the op before it and runs the linears on VNNI int8 kernels: 1.5x OpenVINO bfloat16 with
every encoder linear in int8 (docs/benchmarks.md, "Static int8"). Every linear in int8 moves ~5% of levels,
though, so a plan keeps only the linears the grade tolerates: each is measured alone, and the least harmful
are added until the level agreement with float32 on held-out pairs would drop below the target (99%).

A plan (`int8.json` beside the weights) holds, per quantised linear, the activation range (asymmetric 8-bit,
per tensor) and, for the inputs that come from a LayerNorm or the attention, a SmoothQuant vector `s` (x / s
and W * s: outlier channels move into the weights, alpha 0.5). Weights are symmetric 8-bit per output channel,
computed from the checkpoint's weights when the graph is built. The float checkpoint is unchanged, so
transformers and the torch path read it as before.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.bert import BertForRelevance
from model.device import cpu_flags

PLAN_FILE = "int8.json"
ALPHA = 0.5  # SmoothQuant's migration strength (0.5 measured better than 0.65 and 0.8 on model/default)
PERCENTILE = 99.999  # of the calibration activations: the range clips the rarest outliers
UNSMOOTHED = (".down",)  # the FFN's second linear takes GELU's output: its outliers are the signal
Z95 = 1.645  # one-sided 95% normal bound on a measured agreement (select)
# Said with the plan on a CPU without VNNI: there u8 x s8 products go through vpmaddubsw, whose int16 sums
# saturate, and OpenVINO's kernels compute other integers than the plan was chosen on (docs/benchmarks.md).
NO_VNNI = (
    "no VNNI on this CPU: OpenVINO's int8 kernels kept 98.0% of float32's dev levels here (99.1% with VNNI)"
    " and ran no faster than float32 (AMD EPYC Zen 3); dtype=float32 serves better"
)


def cpu_has_vnni() -> bool:
    """The CPU multiplies u8 x s8 into int32 without saturating (AVX512-VNNI, AVX-VNNI or AMX-INT8)."""
    return not cpu_flags().isdisjoint({"avx512_vnni", "avx_vnni", "amx_int8"})


@dataclass(frozen=True)
class LinearPlan:
    lo: float  # the activation range after smoothing, quantised as uint8 over [lo, hi]
    hi: float
    smooth: tuple[float, ...] | None = None  # per input channel: x / s, W * s

    @property
    def scale_zero(self) -> tuple[float, int]:
        scale = max(self.hi - self.lo, 1e-8) / 255
        return scale, min(255, max(0, round(-self.lo / scale)))


@dataclass
class Int8Plan:
    linears: dict[str, LinearPlan]
    about: dict[str, Any] = field(default_factory=dict)  # how it was made and what it measured (qtrel quantize)

    def save(self, model_dir: str | Path) -> Path:
        path = Path(model_dir) / PLAN_FILE
        rows = {
            k: {"lo": p.lo, "hi": p.hi, "smooth": None if p.smooth is None else [round(x, 6) for x in p.smooth]}
            for k, p in self.linears.items()
        }
        path.write_text(json.dumps({"format": 1, "about": self.about, "linears": rows}, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, model_dir: str | Path) -> Int8Plan | None:
        """The checkpoint's plan, None where it has none. Raises ValueError for a file that is not one."""
        path = Path(model_dir) / PLAN_FILE
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
            if d.get("format") != 1:
                raise ValueError(f"unknown format {d.get('format')!r}")
            linears = {
                k: LinearPlan(float(v["lo"]), float(v["hi"]), None if v["smooth"] is None else tuple(v["smooth"]))
                for k, v in d["linears"].items()
            }
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not an int8 plan: {e}") from None
        return cls(linears, d.get("about", {}))

    def check(self, module: BertForRelevance) -> None:
        """Raises ValueError where the plan does not fit the module (another checkpoint's plan)."""
        for name, p in self.linears.items():
            lin = dict(module.named_modules()).get(name)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"{PLAN_FILE}: {name} is not a linear layer of this model")
            if p.smooth is not None and len(p.smooth) != lin.in_features:
                raise ValueError(f"{PLAN_FILE}: {name} takes {lin.in_features} inputs, the plan has {len(p.smooth)}")
            if not p.lo < p.hi:
                raise ValueError(f"{PLAN_FILE}: {name} has an empty range [{p.lo}, {p.hi}]")


class FakeQuantLinear(nn.Module):
    """A linear whose input and weight pass through quantise-dequantise: exported to ONNX as QuantizeLinear /
    DequantizeLinear pairs, which OpenVINO turns into an int8 matmul."""

    inv_s: Tensor
    weight: Tensor
    w_scale: Tensor
    w_zero: Tensor

    def __init__(self, lin: nn.Linear, plan: LinearPlan):
        super().__init__()
        w = lin.weight.detach().float()
        s = torch.ones(w.shape[1]) if plan.smooth is None else torch.tensor(plan.smooth, dtype=torch.float32)
        self.register_buffer("inv_s", 1 / s)
        w = w * s
        self.register_buffer("weight", w)
        self.register_buffer("w_scale", weight_scale(w))
        self.register_buffer("w_zero", torch.zeros(w.shape[0], dtype=torch.int32))
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().float(), requires_grad=False)
        self.scale, self.zero = plan.scale_zero
        self.smoothed = plan.smooth is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.smoothed:
            x = x * self.inv_s
        x = torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero, 0, 255)
        w = torch.fake_quantize_per_channel_affine(self.weight, self.w_scale, self.w_zero, 0, -128, 127)
        return F.linear(x, w, self.bias)


def linear_named(module: nn.Module, name: str) -> nn.Linear:
    lin = module.get_submodule(name)
    assert isinstance(lin, nn.Linear)
    return lin


def encoder_linears(module: BertForRelevance) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and n.startswith("bert.layers.")]


def weight_scale(w: Tensor) -> Tensor:
    """Symmetric int8 scale per output channel of a (out, in) weight."""
    return w.abs().amax(1).clamp(min=1e-12) / 127


def replaced(
    module: BertForRelevance, names: Sequence[str], make: Callable[[str, nn.Linear], nn.Module]
) -> BertForRelevance:
    """A copy of `module` in eval mode with each named linear replaced by `make(name, linear)`."""
    q = copy.deepcopy(module).eval()
    for name in names:
        parent, _, attr = name.rpartition(".")
        setattr(q.get_submodule(parent), attr, make(name, linear_named(q, name)))
    return q


def apply(module: BertForRelevance, plan: Int8Plan) -> BertForRelevance:
    """A copy of the float32 `module` with the plan's linears quantise-dequantised (for export)."""
    plan.check(module)
    return replaced(module, list(plan.linears), lambda name, lin: FakeQuantLinear(lin, plan.linears[name]))


Batch = tuple[Tensor, Tensor, Tensor]  # padded input ids, token types, attention mask


@torch.no_grad()
def calibrate(module: BertForRelevance, batches: Sequence[Batch], alpha: float = ALPHA) -> dict[str, LinearPlan]:
    """A plan for every encoder linear from its inputs on `batches` (real tokens only: padding is not data)."""
    seen: dict[str, list[Tensor]] = {}
    mask: list[Tensor] = []
    hooks = []
    for name in encoder_linears(module):

        def hook(_m: nn.Module, inputs: tuple[Tensor, ...], _out: Tensor, name: str = name) -> None:
            seen.setdefault(name, []).append(inputs[0].detach().float()[mask[0]])

        hooks.append(module.get_submodule(name).register_forward_hook(hook))
    try:
        for ids, seg, att in batches:
            mask[:] = [att.bool()]
            module(ids, seg, att)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, xs in seen.items():
        x = torch.cat(xs)  # (tokens, in)
        smooth = None
        if not name.endswith(UNSMOOTHED):
            w = linear_named(module, name).weight.detach().float()
            s = x.abs().amax(0).clamp(min=1e-5) ** alpha / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)
            x = x / s
            smooth = tuple(s.tolist())
        flat = x.flatten()
        k = max(1, int(flat.numel() * (1 - PERCENTILE / 100)))
        hi, lo = flat.topk(k).values[-1].item(), -(-flat).topk(k).values[-1].item()
        out[name] = LinearPlan(min(lo, 0.0), max(hi, 0.0), smooth)  # 0 stays exact (padding, GELU's floor)
    return out


def select(
    candidates: dict[str, LinearPlan],
    levels_with: Callable[[dict[str, LinearPlan]], Tensor],
    want: Tensor,
    target: float,
) -> tuple[dict[str, LinearPlan], dict[str, Any]]:
    """The largest set of linears, least harmful first, whose levels agree with `want` (float32's) on at
    least `target` of the pairs: each linear measured alone, then the longest prefix of that order that holds
    (binary search: the agreement falls, with noise, as linears are added). "Holds" is judged on a one-sided
    95% lower bound of the agreement, not the measured share: the search stops where the measured share
    just clears the target, and there the noise is on its side (model/pruned: 99.0% at selection, 98.0% on
    dev without the bound)."""
    n = len(want)

    def agreement(linears: dict[str, LinearPlan]) -> float:
        return (levels_with(linears) == want).float().mean().item()

    def holds(a: float) -> bool:
        return a - Z95 * math.sqrt(max(a * (1 - a), 1e-12) / n) >= target

    alone = {name: agreement({name: p}) for name, p in candidates.items()}
    order = sorted(candidates, key=lambda n: -alone[n])
    lo, hi = 0, len(order)
    kept = 1.0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        a = agreement({name: candidates[name] for name in order[:mid]})
        if holds(a):
            lo, kept = mid, a
        else:
            hi = mid - 1
    chosen = {n: candidates[n] for n in order[:lo]}
    return chosen, {"alone": {n: round(a, 5) for n, a in alone.items()}, "selection_agreement": round(kept, 5)}
