"""The native kernel library: which variant this CPU runs, and its C ABI as Python calls on tensors.

The package build compiles one library per instruction-set variant of the platform into `lib/`
(CMakeLists.txt beside this file; `lib/variants.json` lists them best first with the CPU features
each needs). Here the CPU probe library names this machine's features, the best variant it can run
is loaded with ctypes, and `Kernels` wraps the C functions (src/include/moescope_kernels.h) in the
calls the decode paths make: tensors in, tensors out, shapes and dtypes checked on the way.
Nothing is compiled at run time.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Sequence
from ctypes import POINTER, c_char_p, c_double, c_int, c_int32, c_int64, c_void_p
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.formats.blocks import FORMATS, FP8, BlockFormat

LIB_DIR = Path(__file__).with_name("lib")
SOURCE_DIR = Path(__file__).with_name("src")
VARIANT_ENV = "MOESCOPE_KERNEL_VARIANT"  # runs this variant instead of the best one (A/B runs, tests)
ABI_VERSION = 5


class KernelError(RuntimeError):
    """A kernel refused its arguments (the message says which and why)."""


# ----------------------------------------------------------------------------- choosing a variant


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    file: str
    requires: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    """The variant to load (None: none can run here) and, for the user, why not a better one."""

    variant: Variant | None
    features: frozenset[str]
    passed_over: tuple[tuple[Variant, str], ...] = ()  # better variants, and why each was not taken
    problem: str = ""
    forced: bool = False  # VARIANT_ENV named it


def manifest(lib_dir: Path = LIB_DIR) -> dict:
    """What the package build made (lib/variants.json); {} where it made nothing."""
    try:
        return json.loads((lib_dir / "variants.json").read_text())
    except (OSError, ValueError):
        return {}


def variants(lib_dir: Path = LIB_DIR) -> list[Variant]:
    """The variants this install carries, best first."""
    return [Variant(v["name"], v["label"], v["file"], tuple(v["requires"])) for v in manifest(lib_dir).get("variants", [])]


def cpu_features(lib_dir: Path = LIB_DIR) -> frozenset[str]:
    """The instruction-set features of this CPU and OS that the variants ask for (the probe library's names)."""
    built = manifest(lib_dir)
    probe = ctypes.CDLL(str(lib_dir / built["probe"]))
    probe.moescope_cpu_features.restype = c_char_p
    return frozenset(probe.moescope_cpu_features().decode().split())


def choose(lib_dir: Path = LIB_DIR, wanted: str | None = None) -> Choice:
    """The best variant this CPU runs, or the one `wanted` names (VARIANT_ENV by default)."""
    built = manifest(lib_dir)
    if not built:
        return Choice(None, frozenset(), problem="this install has no native kernels (lib/variants.json is missing; "
                                                 "reinstall MoEScope, or run pip install -e . in a checkout)")
    if built.get("problem"):
        return Choice(None, frozenset(), problem=built["problem"])
    try:
        features = cpu_features(lib_dir)
    except (OSError, KeyError) as exc:
        return Choice(None, frozenset(), problem=f"the CPU probe did not load ({exc})")
    wanted = (os.environ.get(VARIANT_ENV, "") if wanted is None else wanted).strip()
    candidates = variants(lib_dir)
    if wanted:
        named = [v for v in candidates if v.name == wanted]
        if not named:
            raise ValueError(f"{VARIANT_ENV}={wanted} is not a variant of this install: use "
                             + ", ".join(v.name for v in candidates))
        missing = sorted(set(named[0].requires) - features)
        if missing:
            return Choice(None, features, problem=f"variant {wanted} needs {', '.join(missing)}, which this CPU lacks")
        better = tuple((v, f"{VARIANT_ENV}={wanted}") for v in candidates[: candidates.index(named[0])])
        return Choice(named[0], features, better, forced=True)
    passed: list[tuple[Variant, str]] = []
    for v in candidates:
        missing = sorted(set(v.requires) - features)
        if not missing:
            return Choice(v, features, tuple(passed))
        passed.append((v, "the CPU lacks " + ", ".join(missing)))
    return Choice(None, features, tuple(passed), "no variant of this install runs on this CPU")


def runnable(lib_dir: Path = LIB_DIR) -> list[Variant]:
    """The variants of this install this CPU can run, best first ([] where the probe does not load)."""
    try:
        features = cpu_features(lib_dir)
    except (OSError, KeyError):
        return []
    return [v for v in variants(lib_dir) if set(v.requires) <= features]


def sources_changed(lib_dir: Path = LIB_DIR, source_dir: Path = SOURCE_DIR) -> bool:
    """In a checkout: whether the C++ sources differ from those the libraries were built from (the
    same hash CMakeLists.txt records). An installed package carries no sources: False."""
    recorded = manifest(lib_dir).get("sources")
    if not recorded or not source_dir.is_dir():
        return False
    lines = []
    for path in sorted(p for p in source_dir.rglob("*") if p.suffix in (".h", ".cpp")):
        rel = path.relative_to(source_dir).as_posix()
        lines.append(f"{rel}:{hashlib.sha256(path.read_bytes()).hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest() != recorded


# ----------------------------------------------------------------------------- the C ABI's types


class _Matrix(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("type", c_int32), ("rows", c_int64), ("cols", c_int64), ("row_bytes", c_int64)]


class _Vector(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("len", c_int64)]


class _Gate(ctypes.Structure):
    _fields_ = [("interleaved", c_int32), ("clamped_swiglu", c_int32), ("alpha", c_double), ("limit", c_double)]


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", _Matrix), ("down", _Matrix), ("gate_up_bias", _Vector), ("down_bias", _Vector)]


class _Kv(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("heads", c_int64), ("capacity", c_int64), ("width", c_int64),
                ("head_stride", c_int64), ("position_stride", c_int64), ("element_stride", c_int64)]


_M = POINTER(_Matrix)
_P = c_void_p
_I = c_int64
_SIGNATURES: dict[str, tuple] = {
    "moescope_abi_version": (c_int, []),
    "moescope_last_error": (c_char_p, []),
    "moescope_variant": (c_char_p, []),
    "moescope_code_path": (c_char_p, []),
    "moescope_bf16_dot_products": (c_int, []),
    "moescope_set_threads": (None, [c_int]),
    "moescope_set_integer_dots": (None, [c_int]),
    "moescope_set_int8_inputs": (None, [c_int]),
    "moescope_set_amx": (None, [c_int]),
    "moescope_amx": (c_int, []),
    "moescope_format_traits": (c_int, [c_int32, POINTER(c_int64), POINTER(c_int64)]),
    "moescope_gemv": (c_int, [_M, _P, _Vector, _P]),
    "moescope_dequantize": (c_int, [_M, _P, c_int]),
    "moescope_quantize": (c_int, [_P, c_int, _I, _I, c_int32, _P]),
    "moescope_linear_rows": (c_int, [_M, _P, _I, _Vector, c_int, _P]),
    "moescope_rms_norm": (c_int, [_P, _I, _Vector, c_double, c_int, _P]),
    "moescope_qkv_rope": (c_int, [_P, _I, _M, _M, _M, _Vector, _Vector, c_double, _Vector, _Vector, _I,
                                  POINTER(_Vector), _P, _P, _P]),
    "moescope_attend": (c_int, [_P, _I, _I, POINTER(_Kv), POINTER(_Kv), _I, c_double, _Vector, c_int, _P]),
    "moescope_latent_attend": (c_int, [_M, _P, _P, _I, _I, _I, _P, _I, _P, _I, _I, _I, c_double, _P]),
    "moescope_moe_decode": (c_int, [_P, _I, POINTER(_Expert), _I, _P, c_int, c_int, POINTER(_Gate), _P]),
    "moescope_combine_rows": (c_int, [_P, _I, _I, _P, c_int, _P, _I, _P]),
    "moescope_moe_prompt": (c_int, [_P, _I, _I, _P, _P, POINTER(_Expert), _I, POINTER(_Gate), c_int, _P]),
    "moescope_step_new": (_P, [_M, _Vector, c_double, _M, _I, c_int, c_int, c_int, c_int]),
    "moescope_step_free": (None, [_P]),
    "moescope_step_add_layer": (c_int, [_P, _Vector, c_double, _M, _Vector, c_double]),
    "moescope_step_set_attention": (c_int, [_P, _I, _M, _M, _M, _Vector, _Vector, c_double, _I, c_double, _I]),
    "moescope_step_set_latent_attention": (c_int, [_P, _I, _M, _Vector, c_double, _M, _M, _Vector, c_double, _M,
                                                   _I, _I, _I, _I, c_double, c_int]),
    "moescope_step_set_router": (c_int, [_P, _I, _M]),
    "moescope_step_set_grouped_router": (c_int, [_P, _I, _P, _I, _I, _P, _I, _I, c_double]),
    "moescope_step_set_experts": (c_int, [_P, _I, POINTER(_Expert), _I, c_int, POINTER(_Gate)]),
    "moescope_step_set_attention_biases": (c_int, [_P, _I, _Vector, _Vector, _Vector]),
    "moescope_step_set_attention_extras": (c_int, [_P, _I, _Vector, c_int, _Vector]),
    "moescope_step_set_router_bias": (c_int, [_P, _I, _Vector]),
    "moescope_step_set_shared_expert": (c_int, [_P, _I, _M, _M, _M, _Vector]),
    "moescope_step_run": (c_int, [_P, _I, _P, _Vector, _Vector, POINTER(_Kv), POINTER(_Kv), _P, _P, _I, _P, _I, _P, _I]),
    "moescope_step_phase_names": (c_char_p, []),
    "moescope_step_phase_seconds": (c_int, [_P, POINTER(c_double), c_int]),
}

_NONE = _Vector(None, 0)
# the formats moescope_quantize writes (src/formats/quantize.h); MXFP4 stays with the gguf package
QUANTIZED_NATIVELY = frozenset({"q8_0", "q4_0", "q5_0", "q2_k", "q3_k", "q4_k", "q6_k"})
# elements and bytes per block by GGML type (tests/test_native_library.py holds the kernels' own table to it)
_BLOCKS = {f.ggml_type: (f.block, f.block_bytes) for f in (*FORMATS.values(), FP8)}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise KernelError(message)


def _vector(t: torch.Tensor | None, name: str) -> _Vector:
    """A bf16 CPU vector as the ABI takes it (none: null); it holds the tensor it points into."""
    if t is None:
        return _NONE
    _check(t.dtype == torch.bfloat16 and t.device.type == "cpu", f"{name}: a contiguous bf16 CPU vector is needed")
    t = t.contiguous()
    vector = _Vector(t.data_ptr(), t.numel())
    vector.tensor = t
    return vector


def _bf16(t: torch.Tensor, what: str) -> torch.Tensor:
    _check(t.dtype == torch.bfloat16 and t.device.type == "cpu", f"{what}: bf16 CPU tensors are needed")
    return t.contiguous()


def _kv(t: torch.Tensor, what: str) -> _Kv:
    _check(t.dim() == 4 and t.size(0) == 1 and t.dtype == torch.bfloat16 and t.device.type == "cpu",
           f"{what}: a bf16 CPU buffer [1, heads, positions, width] is needed")
    stride = t.stride()
    return _Kv(t.data_ptr(), t.size(1), t.size(2), t.size(3), stride[1], stride[2], stride[3])


class Weight:
    """A matrix as the kernels take it: a bf16 [rows, cols] tensor (type 0), or a uint8 [rows, row
    bytes] tensor of blocks of a GGML type with `cols` logical columns. Keeps the tensor alive."""

    __slots__ = ("cols", "matrix", "tensor", "type")

    def __init__(self, tensor: torch.Tensor, type: int = 0, cols: int = 0) -> None:  # "type": as the callers name it
        _check(tensor.device.type == "cpu" and tensor.dim() == 2 and tensor.stride(1) == 1,
               "weight: a 2-D CPU matrix with contiguous rows is needed")
        if type == 0:
            _check(tensor.dtype == torch.bfloat16, "weight: a bf16 CPU tensor is needed")
            cols = tensor.size(1)
            row_bytes = 2 * tensor.stride(0)
        else:
            block = _BLOCKS.get(type)
            _check(tensor.dtype == torch.uint8 and block is not None, "weight: uint8 blocks of a supported GGML type are needed")
            elements, size = block
            _check(cols > 0 and cols % elements == 0 and tensor.size(1) == cols // elements * size,
                   f"weight: {cols} columns do not match {tensor.size(1)} bytes a row of type {type}")
            row_bytes = tensor.stride(0)
        self.tensor, self.type, self.cols = tensor, type, cols
        self.matrix = _Matrix(tensor.data_ptr(), type, tensor.size(0), cols, row_bytes)


@dataclass
class GateRecipe:
    """How an expert's gate/up projection becomes its activation (engine/decode/modules/expert_recipe.py)."""

    interleaved: bool = False
    clamped_swiglu: bool = False
    alpha: float = 1.0
    limit: float = 0.0

    def native(self) -> _Gate:
        return _Gate(int(self.interleaved), int(self.clamped_swiglu), self.alpha, self.limit)


def _experts(gate_up: Sequence[Weight], down: Sequence[Weight], gate_up_bias: Sequence[torch.Tensor],
             down_bias: Sequence[torch.Tensor]) -> ctypes.Array:
    """The experts as an ABI array, holding the bias tensors it points into."""
    n = len(gate_up)
    _check(n > 0 and len(down) == n, "one gate_up and one down per expert")
    _check(len(gate_up_bias) in (0, n) and len(down_bias) in (0, n), "one gate_up and one down bias per expert, or none")
    keep: list = []
    out = (_Expert * n)()
    for e in range(n):
        out[e].gate_up, out[e].down = gate_up[e].matrix, down[e].matrix
        if gate_up_bias:
            keep.append(_vector(gate_up_bias[e], "gate_up bias"))  # copied into the array: held apart
            out[e].gate_up_bias = keep[-1]
        if down_bias:
            keep.append(_vector(down_bias[e], "down bias"))
            out[e].down_bias = keep[-1]
    out.keep = keep
    return out


class Kernels:
    """One loaded variant: the calls the decode paths make, on tensors."""

    Weight = Weight
    GateRecipe = GateRecipe

    def __init__(self, path: Path, variant: Variant | None = None) -> None:
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        if lib.moescope_abi_version() != ABI_VERSION:
            raise OSError(f"{path.name} has ABI {lib.moescope_abi_version()}, this package needs {ABI_VERSION}")
        self.lib, self.path = lib, path
        self.variant = variant or Variant(lib.moescope_variant().decode(), "", path.name, ())
        self._threads = 0
        self.phase_names = tuple(lib.moescope_step_phase_names().decode().split(","))

    # ---- the library itself

    def _call(self, name: str, *args) -> None:
        threads = torch.get_num_threads()
        if threads != self._threads:  # the kernels use as many threads as torch does
            self.lib.moescope_set_threads(threads)
            self._threads = threads
        if getattr(self.lib, name)(*args) != 0:
            raise KernelError(self.lib.moescope_last_error().decode())

    def use_int8_inputs(self, on: bool) -> None:
        """The integer dots of K-quant matrices take their inputs rounded to 8 bits (opt-in, lossy:
        --int8-inputs) or at 16 bits. A setting of the loaded library, shared by every Kernels of it
        (so not cached here): every native path sets it before it runs, from its model's live setting."""
        self.lib.moescope_set_int8_inputs(int(on))

    def code_path(self) -> str:
        """Which code paths this variant compiled (avx2, avx512-bf16-vnni-amx, neon-dotprod, ...)."""
        return self.lib.moescope_code_path().decode()

    def bf16_dot_products(self) -> bool:
        """Whether this variant multiplies bf16 tiles with the CPU's bf16 dot products."""
        return bool(self.lib.moescope_bf16_dot_products())

    def amx(self) -> bool:
        """Whether a prompt's bf16 products run on AMX tiles."""
        return bool(self.lib.moescope_amx())

    # Switched by tests and benchmarks only, through testing.forced_paths, which restores the default.
    def _set_amx(self, on: bool) -> None:
        """A prompt's bf16 products run on AMX tiles where granted (default) or on the dot products."""
        self.lib.moescope_set_amx(int(on))

    def _set_integer_dots(self, on: bool) -> None:
        """Block types with an integer kernel use it (default) or the reference-exact float loops."""
        self.lib.moescope_set_integer_dots(int(on))

    def format_traits(self, ggml_type: int) -> tuple[int, int] | None:
        """(elements, bytes) per block of a type, as the kernels know it; None for bf16 and unknown ids."""
        elements, size = c_int64(), c_int64()
        if self.lib.moescope_format_traits(ggml_type, ctypes.byref(elements), ctypes.byref(size)) != 0:
            return None
        return elements.value, size.value

    # ---- one-call kernels

    def gemv(self, weight: Weight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = W x (+ bias) for one bf16 row x (any leading shape of size 1), as F.linear."""
        _check(x.numel() == weight.cols and x.dtype == torch.bfloat16, "x: one bf16 row of the weight's width needed")
        x = x.contiguous()
        y = torch.empty((*x.shape[:-1], weight.matrix.rows), dtype=torch.bfloat16)
        b = _vector(bias, "bias")
        self._call("moescope_gemv", ctypes.byref(weight.matrix), x.data_ptr(), b, y.data_ptr())
        return y

    def dequantize(self, weight: Weight, out: torch.Tensor, bf16_values: bool = False) -> None:
        """The weight in `out` [rows, cols], bf16 or float32: the reference dequantizer's values in
        that dtype; float32 ones rounded through bf16 first with `bf16_values` (what the prompt tiles
        expand a matrix into where the CPU has no bf16 dot products)."""
        _check(out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous()
               and out.numel() == weight.matrix.rows * weight.cols,
               "dequantize: a contiguous bf16 or float32 tensor of rows x cols is needed")
        kind = 0 if out.dtype == torch.bfloat16 else 1 if bf16_values else 2
        self._call("moescope_dequantize", ctypes.byref(weight.matrix), out.data_ptr(), kind)

    def quantize(self, x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
        """float32 or bf16 rows `x` [rows, cols] as uint8 [rows, row bytes] of blocks of `fmt`: the
        bytes of engine.formats.quantize's reference (ValueError for a format no kernel writes)."""
        if fmt.name not in QUANTIZED_NATIVELY:
            raise ValueError(f"no native quantizer writes {fmt.name}")
        _check(x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu",
               "quantize: float32 or bf16 CPU rows are needed")
        _check(x.size(1) % fmt.block == 0,
               f"quantize: {x.size(1)} columns are not a whole number of {fmt.block}-element blocks")
        x = x.contiguous()
        out = torch.empty((x.size(0), fmt.row_bytes(x.size(1))), dtype=torch.uint8)
        if x.numel():
            self._call("moescope_quantize", x.data_ptr(), int(x.dtype == torch.bfloat16), x.size(0), x.size(1),
                       fmt.ggml_type, out.data_ptr())
        return out

    def linear_rows(self, weight: Weight, x: torch.Tensor, bias: torch.Tensor | None = None,
                    int8_inputs: bool = False) -> torch.Tensor:
        """bf16 rows x [m, cols] times a weight matrix's transpose (plus a bias), as F.linear."""
        _check(x.dim() == 2 and x.size(1) == weight.cols and x.dtype == torch.bfloat16,
               "x: bf16 rows of the weight's width needed")
        x = x.contiguous()
        y = torch.empty((x.size(0), weight.matrix.rows), dtype=torch.bfloat16)
        b = _vector(bias, "bias")
        self._call("moescope_linear_rows", ctypes.byref(weight.matrix), x.data_ptr(), x.size(0), b, int(int8_inputs),
                   y.data_ptr())
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, round_once: bool = False) -> torch.Tensor:
        """RMSNorm over the last dimension of a few bf16 rows."""
        n = weight.numel()
        _check(x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and n > 0 and x.size(-1) == n,
               "rms_norm: bf16 rows and a bf16 weight of their width")
        x = x.contiguous()
        w = _vector(weight, "weight")
        y = torch.empty_like(x)
        self._call("moescope_rms_norm", x.data_ptr(), x.numel() // n, w, eps, int(round_once), y.data_ptr())
        return y

    def qkv_rope(self, x: torch.Tensor, wq: Weight, wk: Weight, wv: Weight, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                 biases: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """One token's q [1, heads, 1, d], k and v [1, kv_heads, 1, d]: projections (optional biases),
        optional q/k norms, rotary embedding."""
        x = _bf16(x, "qkv_rope: one bf16 row of the projections' width")
        _check(len(biases) in (0, 3), "qkv_rope: no biases, or one each for q, k and v")
        qn = _vector(q_norm, "q_norm")
        kn = _vector(k_norm, "k_norm")
        c = _vector(cos.reshape(-1), "cos")
        s = _vector(sin.reshape(-1), "sin")
        held = [_vector(b, "q/k/v bias") for b in biases]
        bias_array = (_Vector * 3)(*held) if held else None
        heads, kv_heads = wq.matrix.rows // head_dim, wk.matrix.rows // head_dim
        q = torch.empty((1, heads, 1, head_dim), dtype=torch.bfloat16)
        k = torch.empty((1, kv_heads, 1, head_dim), dtype=torch.bfloat16)
        v = torch.empty((1, kv_heads, 1, head_dim), dtype=torch.bfloat16)
        self._call("moescope_qkv_rope", x.data_ptr(), x.numel(), ctypes.byref(wq.matrix), ctypes.byref(wk.matrix),
                   ctypes.byref(wv.matrix), qn, kn, eps, c, s, head_dim, bias_array, q.data_ptr(), k.data_ptr(),
                   v.data_ptr())
        return [q, k, v]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None, eager_rounding: bool = False) -> torch.Tensor:
        """One query [1, heads, 1, d] over cached keys and values [1, kv_heads, T, d]; returns
        [1, 1, heads * d] (what o_proj takes)."""
        _check(q.dim() == 4 and q.size(0) == 1 and q.size(2) == 1 and keys.dim() == 4 and values.dim() == 4,
               "attend: one query [1, heads, 1, d] and keys/values [1, kv_heads, T, d]")
        _check(keys.shape == values.shape and keys.size(3) == q.size(3),
               "attend: keys and values of the query's head size, whole groups of heads")
        q = _bf16(q, "attend: bf16 CPU tensors")
        heads, d, length = q.size(1), q.size(3), keys.size(2)
        k, v = _kv(keys, "attend: keys"), _kv(values, "attend: values")
        s = _vector(sinks, "sinks")
        out = torch.empty((1, 1, heads * d), dtype=torch.bfloat16)
        self._call("moescope_attend", q.data_ptr(), heads, d, ctypes.byref(k), ctypes.byref(v), length, scale, s,
                   int(eager_rounding), out.data_ptr())
        return out

    def latent_attend(self, up: torch.Tensor, q_nope: torch.Tensor, q_rot: torch.Tensor, latents: torch.Tensor,
                      k_rot: torch.Tensor, v_dim: int, scale: float) -> torch.Tensor:
        """One query's multi-head latent attention, up-projection absorbed; returns [1, 1, heads * v]."""
        for t in (up, q_nope, q_rot, latents, k_rot):
            _check(t.dtype == torch.bfloat16 and t.device.type == "cpu", "latent_attend: bf16 CPU tensors")
        _check(up.dim() == 2 and up.is_contiguous() and q_nope.dim() == 2 and q_rot.dim() == 2
               and q_rot.size(0) == q_nope.size(0), "latent_attend: up [heads * (nope + v), rank], q [heads, ...]")
        _check(latents.dim() == 2 and k_rot.dim() == 2 and latents.size(1) == up.size(1)
               and k_rot.size(1) == q_rot.size(1) and latents.size(0) == k_rot.size(0) and latents.stride(1) == 1
               and k_rot.stride(1) == 1, "latent_attend: latents [positions, rank], k_rot [positions, rope]")
        heads, nope, rope = q_nope.size(0), q_nope.size(1), q_rot.size(1)
        qn, qr, w = q_nope.contiguous(), q_rot.contiguous(), Weight(up)
        out = torch.empty((1, 1, heads * v_dim), dtype=torch.bfloat16)
        self._call("moescope_latent_attend", ctypes.byref(w.matrix), qn.data_ptr(), qr.data_ptr(), heads, nope, rope,
                   latents.data_ptr(), latents.stride(0), k_rot.data_ptr(), k_rot.stride(0), latents.size(0), v_dim,
                   scale, out.data_ptr())
        return out

    def moe_decode(self, x: torch.Tensor, gate_up: Sequence[Weight], down: Sequence[Weight], weights: torch.Tensor,
                   gate_up_bias: Sequence[torch.Tensor] = (), down_bias: Sequence[torch.Tensor] = (),
                   transposed: bool = False, recipe: GateRecipe | None = None) -> torch.Tensor:
        """One token through k gated experts, weighted by `weights` and summed."""
        _check(weights.numel() == len(gate_up), "one routing weight per expert")
        x = _bf16(x, "x: a bf16 row")
        experts = _experts(gate_up, down, gate_up_bias, down_bias)
        route = weights.float().contiguous()
        gate = (recipe or GateRecipe()).native()
        y = torch.empty_like(x)
        self._call("moescope_moe_decode", x.data_ptr(), x.numel(), experts, len(gate_up), route.data_ptr(),
                   int(weights.dtype == torch.bfloat16), int(transposed), ctypes.byref(gate), y.data_ptr())
        return y

    def combine_rows(self, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        """A prompt's expert outputs (rows sorted by expert) weighted and summed per token."""
        _check(y.dim() == 2 and y.dtype == torch.bfloat16, "combine_rows: bf16 rows")
        n, hidden = y.shape
        _check(top_k > 0 and n % top_k == 0, "combine_rows: whole tokens of top_k rows")
        _check(weights.dtype in (torch.float32, torch.bfloat16) and weights.numel() == n,
               "combine_rows: a float32 or bf16 weight per row")
        _check(order.dtype == torch.long and order.numel() == n, "combine_rows: an int64 place per row")
        rows, w, places = y.contiguous(), weights.float().contiguous(), order.contiguous()
        out = torch.empty((n // top_k, hidden), dtype=torch.bfloat16)
        self._call("moescope_combine_rows", rows.data_ptr(), n, hidden, w.data_ptr(),
                   int(weights.dtype == torch.bfloat16), places.data_ptr(), top_k, out.data_ptr())
        return out

    def moe_prompt(self, x: torch.Tensor, start: Sequence[int], count: Sequence[int], gate_up: Sequence[Weight],
                   down: Sequence[Weight], gate_up_bias: Sequence[torch.Tensor] = (),
                   down_bias: Sequence[torch.Tensor] = (), recipe: GateRecipe | None = None,
                   int8_inputs: bool = False) -> torch.Tensor:
        """A prompt's rows, sorted by expert (rows start[e] .. start[e] + count[e] through expert e),
        through a layer's gated experts; each row's expert output in the same row of the result."""
        _check(x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1,
               "x: a bf16 CPU tensor is needed, a 2-D matrix with contiguous rows")
        x = x.contiguous()
        n = len(gate_up)
        _check(len(start) == n and len(count) == n, "one row range per expert")
        experts = _experts(gate_up, down, gate_up_bias, down_bias)
        starts, counts = (c_int64 * n)(*start), (c_int64 * n)(*count)
        gate = (recipe or GateRecipe()).native()
        y = torch.empty_like(x)
        self._call("moescope_moe_prompt", x.data_ptr(), x.size(0), x.size(1), starts, counts, experts, n,
                   ctypes.byref(gate), int(int8_inputs), y.data_ptr())
        return y

    def NativeWholeTokenStep(self, *args, **kwargs) -> NativeWholeTokenStep:
        return NativeWholeTokenStep(self, *args, **kwargs)


@dataclass
class _LayerViews:
    """One layer's KV buffers as the step last saw them, so a token reuses their ABI views."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


@dataclass
class _Held:
    """What the step's layers refer to, by layer and role, kept alive while it does."""

    refs: dict = field(default_factory=dict)

    def hold(self, layer: int, role: str, *things) -> None:
        self.refs[(layer, role)] = things


class NativeWholeTokenStep:
    """The whole-token step (src/step/whole_token_step.h): set up once per model, then one call per
    token, or per turn of several replies' tokens."""

    MAX_ROWS = 64  # WholeTokenStep::kMaxRows

    def __init__(self, kernels: Kernels, embed: torch.Tensor, final_norm: torch.Tensor, final_eps: float,
                 lm_head: Weight, top_k: int, normalize: bool, cast_back: bool, softmax_of_top: bool = False,
                 norms_round_once: bool = False) -> None:
        self.kernels = kernels
        self._embed = Weight(embed)
        norm = _vector(final_norm, "norm")
        self._held = _Held()
        self._held.hold(-1, "model", self._embed, norm, lm_head)
        handle = kernels.lib.moescope_step_new(ctypes.byref(self._embed.matrix), norm, final_eps,
                                               ctypes.byref(lm_head.matrix), top_k, int(normalize), int(cast_back),
                                               int(softmax_of_top), int(norms_round_once))
        if not handle:
            raise KernelError(kernels.lib.moescope_last_error().decode())
        self._handle = handle
        self._vocab = lm_head.matrix.rows
        self._layers = 0
        self._views: list[list[_LayerViews]] = [[] for _ in range(self.MAX_ROWS)]  # per row of a step, per layer
        self._keys = self._values = None
        self._starts = self._lengths = self._tokens = None

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self.kernels.lib.moescope_step_free(handle)

    def _call(self, name: str, *args) -> None:
        self.kernels._call(name, self._handle, *args)

    def add_layer(self, input_norm: torch.Tensor, input_eps: float, wo: Weight, post_norm: torch.Tensor,
                  post_eps: float) -> None:
        a = _vector(input_norm, "input_layernorm")
        b = _vector(post_norm, "post_attention_layernorm")
        self._call("moescope_step_add_layer", a, input_eps, ctypes.byref(wo.matrix), b, post_eps)
        self._held.hold(self._layers, "layer", a, b, wo)
        self._layers += 1
        for views in self._views:
            views.append(_LayerViews())

    def set_attention(self, layer: int, wq: Weight, wk: Weight, wv: Weight, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, qk_eps: float, head_dim: int, scale: float,
                      rotary_dim: int) -> None:
        qn = _vector(q_norm, "q_norm")
        kn = _vector(k_norm, "k_norm")
        self._call("moescope_step_set_attention", layer, ctypes.byref(wq.matrix), ctypes.byref(wk.matrix),
                   ctypes.byref(wv.matrix), qn, kn, qk_eps, head_dim, scale, rotary_dim)
        self._held.hold(layer, "attention", wq, wk, wv, qn, kn)

    def set_latent_attention(self, layer: int, q_a: Weight | None, q_a_norm: torch.Tensor | None, q_a_eps: float,
                             q_b: Weight, kv_a: Weight, kv_a_norm: torch.Tensor, kv_a_eps: float, up: torch.Tensor,
                             heads: int, nope: int, rope: int, v_dim: int, scale: float, interleaved: bool) -> None:
        qa = q_a.matrix if q_a is not None else _Matrix(None, 0, 0, 0, 0)
        qan = _vector(q_a_norm, "q_a_layernorm")
        kvn = _vector(kv_a_norm, "kv_a_layernorm")
        _check(up.dtype == torch.bfloat16 and up.dim() == 2 and up.is_contiguous(),
               "kv_b_proj: a contiguous [heads * (nope + v), rank] matrix")
        upw = Weight(up)
        self._call("moescope_step_set_latent_attention", layer, ctypes.byref(qa), qan, q_a_eps, ctypes.byref(q_b.matrix),
                   ctypes.byref(kv_a.matrix), kvn, kv_a_eps, ctypes.byref(upw.matrix), heads, nope, rope, v_dim, scale,
                   int(interleaved))
        self._held.hold(layer, "attention", q_a, qan, q_b, kv_a, kvn, upw)

    def set_router(self, layer: int, router: torch.Tensor) -> None:
        w = Weight(router)
        self._call("moescope_step_set_router", layer, ctypes.byref(w.matrix))
        self._held.hold(layer, "router", w)

    def set_grouped_router(self, layer: int, weight: torch.Tensor, correction: torch.Tensor, groups: int,
                           top_groups: int, routed_scale: float) -> None:
        _check(weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous(),
               "grouped router: a contiguous float32 [experts >= top_k, hidden] weight")
        _check(correction.dtype == torch.float32 and correction.is_contiguous() and correction.numel() == weight.size(0),
               "grouped router: a float32 correction bias per expert")
        self._call("moescope_step_set_grouped_router", layer, weight.data_ptr(), weight.size(0), weight.size(1),
                   correction.data_ptr(), groups, top_groups, routed_scale)
        self._held.hold(layer, "router", weight, correction)

    def set_experts(self, layer: int, gate_up: Sequence[Weight], down: Sequence[Weight],
                    gate_up_bias: Sequence[torch.Tensor] = (), down_bias: Sequence[torch.Tensor] = (),
                    transposed: bool = False, recipe: GateRecipe | None = None) -> None:
        """Every expert of `layer`, by expert id (they move when the cache re-plans its slots)."""
        experts = _experts(gate_up, down, gate_up_bias, down_bias)
        gate = (recipe or GateRecipe()).native()
        self._call("moescope_step_set_experts", layer, experts, len(gate_up), int(transposed), ctypes.byref(gate))
        self._held.hold(layer, "experts", list(gate_up), list(down), experts)

    def set_attention_biases(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        held = [_vector(t, "q/k/v bias") for t in (q, k, v)]
        self._call("moescope_step_set_attention_biases", layer, *held)
        self._held.hold(layer, "biases", *held)

    def set_attention_extras(self, layer: int, sinks: torch.Tensor | None, eager_rounding: bool,
                             o_bias: torch.Tensor | None) -> None:
        s = _vector(sinks, "sinks")
        o = _vector(o_bias, "o_proj bias")
        self._call("moescope_step_set_attention_extras", layer, s, int(eager_rounding), o)
        self._held.hold(layer, "extras", s, o)

    def set_router_bias(self, layer: int, bias: torch.Tensor) -> None:
        b = _vector(bias, "router bias")
        self._call("moescope_step_set_router_bias", layer, b)
        self._held.hold(layer, "router bias", b)

    def set_shared_expert(self, layer: int, gate_proj: Weight, up_proj: Weight, down_proj: Weight,
                          gate: torch.Tensor | None) -> None:
        g = _vector(gate, "shared_expert_gate")
        self._call("moescope_step_set_shared_expert", layer, ctypes.byref(gate_proj.matrix), ctypes.byref(up_proj.matrix),
                   ctypes.byref(down_proj.matrix), g)
        self._held.hold(layer, "shared", gate_proj, up_proj, down_proj, g)

    def run(self, tokens: Sequence[int], cos: torch.Tensor, sin: torch.Tensor,
            keys: Sequence[Sequence[torch.Tensor]], values: Sequence[Sequence[torch.Tensor]],
            starts: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]], picks: torch.Tensor,
            logit_rows: int | None = None) -> torch.Tensor:
        """`len(tokens)` rows in one step (replies' next tokens, short prompts' tokens); returns the
        logits of the last `logit_rows` rows (all of them unless told) [logit_rows, 1, vocab] in bf16
        and fills `picks` [rows, MoE layers, top_k] (int64) with each MoE layer's experts in order of
        id. cos/sin: [rows, n], each token's rotary row. keys/values/starts/lengths: per row, per
        layer: the cache buffer, attending to positions [start, start + length) besides the token."""
        layers, rows = self._layers, len(tokens)
        _check(0 < rows <= self.MAX_ROWS, f"run: 1 to {self.MAX_ROWS} tokens")
        logit_rows = rows if logit_rows is None else logit_rows
        _check(0 < logit_rows <= rows, "run: the logits of 1 to all of the rows")
        _check(all(len(per_row) == rows for per_row in (keys, values, starts, lengths)),
               "run: one key and one value buffer, start and length per layer, for every token")
        if self._keys is None:
            n = self.MAX_ROWS * layers
            self._keys, self._values = (_Kv * n)(), (_Kv * n)()
            self._starts, self._lengths = (c_int64 * n)(), (c_int64 * n)()
            self._tokens = (c_int64 * self.MAX_ROWS)()
        for r in range(rows):
            _check(all(len(per_layer[r]) == layers for per_layer in (keys, values, starts, lengths)),
                   "run: one key and one value buffer, start and length per layer")
            for i, view in enumerate(self._views[r]):  # the buffers stay the same tensors until the cache grows
                at = r * layers + i
                if view.keys is not keys[r][i]:
                    self._keys[at], view.keys = _kv(keys[r][i], "run: keys"), keys[r][i]
                if view.values is not values[r][i]:
                    self._values[at], view.values = _kv(values[r][i], "run: values"), values[r][i]
            self._starts[r * layers:(r + 1) * layers] = starts[r]
            self._lengths[r * layers:(r + 1) * layers] = lengths[r]
        self._tokens[:rows] = tokens
        _check(picks.dtype == torch.long and picks.is_contiguous(), "run: picks must be a contiguous int64 tensor")
        c = _vector(cos.reshape(-1), "cos")
        s = _vector(sin.reshape(-1), "sin")
        logits = torch.empty((logit_rows, 1, self._vocab), dtype=torch.bfloat16)
        self._call("moescope_step_run", rows, ctypes.addressof(self._tokens), c, s, self._keys, self._values,
                   ctypes.addressof(self._starts), ctypes.addressof(self._lengths), layers, picks.data_ptr(),
                   picks.numel(), logits.data_ptr(), logits.numel())
        return logits

    def phase_seconds(self) -> dict[str, float]:
        """Seconds the steps run so far spent per part (norms, attention, o_proj, router, experts, lm_head)."""
        names = self.kernels.phase_names
        out = (c_double * len(names))()
        self.kernels.lib.moescope_step_phase_seconds(self._handle, out, len(names))
        return dict(zip(names, out, strict=True))
