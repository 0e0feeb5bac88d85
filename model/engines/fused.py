"""The fused C kernels (`model/engines/_kernels.c`, through ctypes): the packed forward's attention in one call
per layer, and its residual add with LayerNorm in one pass (`add_layer_norm`).

Why: torch's CPU attention kernels want padded (b, heads, t, d) blocks, so the packed forward gathered each
group of similar-length pairs into one, attended, and scattered it back, a handful of ops per group and
layer. On Sapphire Rapids that was 40% of the forward for 1.5% of its FLOPs (the flash kernel's set-up per
(pair, head), the gathers, the Python loop); on Zen 3, float32, 10%. This kernel reads each pair's q, k and v
rows where the projection wrote them and writes the context rows in place: no padding, no mask, no copies.

The library is an optional extension built at install (setup.py): where it is missing (no compiler at
install, another architecture) `available()` says why and the model keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "Rows",
    "add_layer_norm",
    "add_norm",
    "amx",
    "available",
    "bf16_dot",
    "bind",
    "norm_supports",
    "packed_attention",
    "parallel",
    "path",
    "rotary_available",
    "rotary_rows",
    "supports",
]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_HERE = Path(__file__).parent


@cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"_kernels{suffix}"
        if path.exists():
            break
    else:
        return None, "not built (no C compiler at install?)"
    try:
        return bind(path), ""
    except OSError as e:
        return None, f"cannot load {path.name}: {e}"


def bind(path: str | Path, openmp: bool = True) -> ctypes.CDLL:
    """The kernel's library at `path`, its entry point typed and handed torch's OpenMP runtime where there is
    one and `openmp` (tests load builds for each ISA, and one without threads, this way)."""
    lib = ctypes.CDLL(str(path))  # CDLL: the call releases the GIL, as torch's kernels do
    f = lib.qtrel_packed_attention
    p, i = ctypes.c_void_p, ctypes.c_int64
    f.argtypes = [ctypes.c_int, p, i, p, i, p, i, p, i, p, p, p, p, i, i, i, ctypes.c_float, p, ctypes.c_int]
    f.restype = ctypes.c_int
    lib.qtrel_bf16_dot.argtypes = [ctypes.c_int]
    lib.qtrel_bf16_dot.restype = ctypes.c_int
    lib.qtrel_amx.argtypes = [ctypes.c_int]
    lib.qtrel_amx.restype = ctypes.c_int
    lib.qtrel_add_layer_norm.argtypes = [ctypes.c_int, p, i, p, i, p, p, p, i, i, i, ctypes.c_float, ctypes.c_int]
    lib.qtrel_add_layer_norm.restype = ctypes.c_int
    if hasattr(lib, "qtrel_rotary"):  # a library built before it lacks it: rotary_available() says so
        lib.qtrel_rotary.argtypes = [ctypes.c_int, p, i, i, p, i, i, p, ctypes.c_int]
        lib.qtrel_rotary.restype = ctypes.c_int
    lib.qtrel_use_openmp.argtypes = [p, p, p]
    lib.qtrel_use_openmp.restype = None
    if openmp and (omp := _openmp()):
        lib.qtrel_use_openmp(*(ctypes.cast(getattr(omp, n), p) for n in _OPENMP))
    return lib


_OPENMP = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's kernels run on (libgomp in torch's wheels; Intel's exports the same entry
    points), so that the kernel's threads are that team's, or None where torch threads otherwise."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    torch_dir = str(Path(torch.__file__).parent)
    try:  # the one torch loaded, by its path: a second runtime would be a second team
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        paths = set()
    for path in sorted(paths, key=lambda x: not x.startswith(torch_dir)):
        try:
            lib = ctypes.CDLL(path)
            if all(hasattr(lib, n) for n in _OPENMP):
                return lib
        except OSError:
            continue
    lib = ctypes.CDLL(None)  # linked into the process (torch built against a system runtime)
    return lib if all(hasattr(lib, n) for n in _OPENMP) else None


def bf16_dot(use: bool | None = None) -> bool:
    """Whether bfloat16 input runs the AVX512-BF16 path (`vdpbf16ps`: two bf16 products per float32 lane, the
    softmax weights rounded to bf16 as torch's bf16 kernels do) rather than float32 arithmetic; on by itself
    where the CPU has the instructions. `use`: turn it on (where it can run) or off, for the A/Bs and tests."""
    lib, _ = _library()
    return lib is not None and bool(lib.qtrel_bf16_dot(-1 if use is None else int(use)))


def amx(use: bool | None = None) -> bool:
    """Whether bfloat16 input with head sizes that are multiples of 32 runs on AMX tiles (scores and context as
    16 x 16 tile products, the softmax as the other paths'); on by itself where the CPU has AMX-BF16 and Linux
    grants the process its tile state. `use`: turn it on (where it can run) or off, for the A/Bs and tests."""
    lib, _ = _library()
    return lib is not None and bool(lib.qtrel_amx(-1 if use is None else int(use)))


def path(dtype: torch.dtype) -> str:
    """Which code the kernel runs for `dtype` on this CPU, as /info reports it."""
    if dtype == torch.bfloat16 and amx():
        return "AMX tiles (head sizes that are multiples of 32)"
    if dtype == torch.bfloat16 and bf16_dot():
        return "AVX512-BF16 dot products"
    return "float32 arithmetic"


def parallel() -> bool:
    """Whether the kernel runs on several threads (torch's OpenMP team) when torch has several."""
    lib, _ = _library()
    return lib is not None and _openmp() is not None


def available() -> tuple[bool, str]:
    """Whether the kernel can run here, and if not, why."""
    lib, why = _library()
    return lib is not None, why


def supports(dtype: torch.dtype, head_size: int) -> bool:
    """The shapes and precisions the kernel computes: float32 or bfloat16, head sizes that are multiples of 8."""
    return dtype in _DTYPES and head_size > 0 and head_size % 8 == 0


def _rows(t: Tensor, width: int, name: str) -> int:
    if t.dim() != 2 or t.device.type != "cpu" or t.stride(1) != 1 or t.shape[1] < width:
        raise ValueError(f"{name} must be a cpu matrix of rows with at least {width} unit-stride columns")
    return t.shape[0]


class Rows:
    """Which rows are each pair's, checked once and reused by every layer of a forward: pair i's queries are
    rows qstart[i] .. qstart[i] + qlen[i] - 1 of q, its keys and values rows kstart[i] .. kstart[i] + klen[i] - 1
    of k and v. `q_rows` and `k_rows`: the rows q and k must have at least."""

    __slots__ = ("_arrays", "k_rows", "n", "pointers", "q_rows")

    def __init__(self, qstart: np.ndarray, qlen: np.ndarray, kstart: np.ndarray, klen: np.ndarray):
        arrays = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in (qstart, qlen, kstart, klen))
        qs, ql, ks, kl = arrays
        n = len(ks)
        if not (len(qs) == len(ql) == len(kl) == n):
            raise ValueError("qstart, qlen, kstart and klen need one entry per pair")
        # the C side trusts every row: out of bounds here would be a crash there (the cap keeps sums from wrapping)
        if n and (min(qs.min(), ql.min(), ks.min()) < 0 or max(qs.max(), ql.max(), ks.max(), kl.max()) > 2**40):
            raise ValueError("a pair's rows lie outside any tensor")
        if n and kl.min() < 1:  # its query rows would be left unwritten
            raise ValueError("a pair has no key")
        self.n = n
        self.q_rows = int((qs + ql).max()) if n else 0
        self.k_rows = int((ks + kl).max()) if n else 0
        self._arrays = arrays  # kept alive for the pointers
        self.pointers = tuple(a.ctypes.data for a in arrays)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    rows: Rows,
    heads: int,
    head_size: int,
    head_mask: Tensor | None = None,
    threads: int | None = None,
    exact: bool = False,
) -> Tensor:
    """Attention of packed pairs: each pair's query rows of `q` (`rows`) attend to its key and value rows of
    `k` and `v`; the context goes to `out` at the query rows. Each row holds `heads` heads of `head_size`
    from column 0 (q, k and v may be column slices of one projection). `head_mask`: (heads,) per-head
    weights, 0 silencing a head. Rows of `out` that no pair names are left as they were. `threads`: how many of
    torch's OpenMP threads split the pairs' heads (default: torch's thread count; one where `parallel()` is
    false); the result is the same on any number. `exact`: bfloat16 input in float32 arithmetic, without the
    AVX512-BF16 dot products or AMX tiles (`path`), whose bfloat16 rounding of the scores' inputs and of the
    softmax weights a pre-norm model carries from layer to layer. Returns `out`."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the fused attention kernel is not available: {why}")
    if not supports(q.dtype, head_size) or not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise ValueError(f"unsupported: {q.dtype}, head size {head_size}")
    width = heads * head_size
    nq, nk = _rows(q, width, "q"), _rows(k, width, "k")
    if _rows(v, width, "v") != nk or _rows(out, width, "out") != nq or not out.is_contiguous():
        raise ValueError("k and v need as many rows; out as many as q, contiguous")
    if rows.q_rows > nq or rows.k_rows > nk:
        raise ValueError("a pair's rows lie outside q, k or v")
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    mask = None
    if head_mask is not None:
        mask = head_mask.detach().to("cpu", torch.float32).contiguous()
        if mask.shape != (heads,):
            raise ValueError(f"head_mask must have shape ({heads},), got {tuple(mask.shape)}")
    rc = lib.qtrel_packed_attention(
        2 if exact and q.dtype == torch.bfloat16 else _DTYPES[q.dtype],
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(), out.stride(0),
        *rows.pointers, rows.n, heads, head_size, head_size**-0.5, None if mask is None else mask.data_ptr(), threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("the fused attention kernel could not allocate its scratch memory")
    return out


def norm_supports(norm: torch.nn.LayerNorm, dtype: torch.dtype) -> bool:
    """Whether `add_layer_norm` computes `norm` in `dtype`: one normalised dimension, a multiple of 8 wide, with
    weight and bias in `dtype` (float32 or bfloat16)."""
    shape = norm.normalized_shape
    return (
        dtype in _DTYPES
        and len(shape) == 1
        and shape[0] % 8 == 0
        and norm.weight is not None
        and norm.bias is not None
        and norm.weight.dtype == norm.bias.dtype == dtype
    )


def add_layer_norm(x: Tensor, r: Tensor, norm: torch.nn.LayerNorm, out: Tensor, threads: int | None = None) -> Tensor:
    """`out` = norm(x + r) for matrices of rows, in one pass: the sum stays float32 (torch rounds it to the
    dtype first). `out` may be `x` or `r`. `threads`: as `packed_attention`'s. Returns `out`."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the fused kernels are not available: {why}")
    if not norm_supports(norm, x.dtype) or not (x.dtype == r.dtype == out.dtype):
        raise ValueError(f"unsupported: {x.dtype} rows, a LayerNorm of {tuple(norm.normalized_shape)}")
    width = norm.normalized_shape[0]
    n = _rows(x, width, "x")
    if _rows(r, width, "r") != n or _rows(out, width, "out") != n or x.shape[1] != width or r.shape[1] != width:
        raise ValueError(f"x, r and out need the same rows, {width} wide")
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    rc = lib.qtrel_add_layer_norm(
        _DTYPES[x.dtype], x.data_ptr(), x.stride(0), r.data_ptr(), r.stride(0), norm.weight.data_ptr(),
        norm.bias.data_ptr(), out.data_ptr(), out.stride(0), n, width, norm.eps, threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("the fused add and LayerNorm could not allocate its scratch memory")
    return out


def add_norm(norm: torch.nn.LayerNorm, x: Tensor, r: Tensor, fused: bool) -> Tensor:
    """norm(x + r), the packed forward's post-norm step: where `fused` (model.engines.kernels.use_fused_norms) in
    one pass, written over `r`, a sublayer's output that nothing else holds; torch's ops under autograd, which
    cannot follow the kernel."""
    if fused and not torch.is_grad_enabled():
        return add_layer_norm(x, r, norm, out=r)
    return norm(x + r)


def rotary_available() -> bool:
    """Whether the library has the in-place rotary kernel (`rotary_rows`)."""
    lib, _ = _library()
    return lib is not None and hasattr(lib, "qtrel_rotary")


def rotary_rows(
    x: Tensor, positions: Tensor, table: Tensor, heads: int, head_size: int, threads: int | None = None
) -> Tensor:
    """Rotary positions in place on rows of `x` (float32 or bfloat16): the first `heads` heads of `head_size` of
    row n turned by the angles of position positions[n] (ModernBERT's q and k heads, one projection's
    columns). `table`: float32 (positions, 2 * head_size), each row cos then sin, rounded to x's dtype first as
    the reference rounds them (model.modernbert.rotary). Returns `x`."""
    lib, why = _library()
    if lib is None or not hasattr(lib, "qtrel_rotary"):
        raise RuntimeError(f"the rotary kernel is not available: {why or 'a library built without it'}")
    if x.dtype not in _DTYPES or head_size % 2:
        raise ValueError(f"unsupported: {x.dtype}, head size {head_size}")
    n = _rows(x, heads * head_size, "x")
    pos = positions.to("cpu", torch.int64).contiguous()
    if pos.shape != (n,) or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError("one position per row and a contiguous float32 table are needed")
    if table.shape[1] != 2 * head_size or (n and not 0 <= int(pos.min()) <= int(pos.max()) < table.shape[0]):
        raise ValueError("a position lies outside the table, or the table is not 2 * head_size wide")
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    lib.qtrel_rotary(
        _DTYPES[x.dtype], x.data_ptr(), x.stride(0), n, pos.data_ptr(), heads, head_size, table.data_ptr(), threads
    )
    return x
