"""The native decode kernels of this install, loaded once per process.

torch's own kernels stream expert-sized bf16 weights for one row well below the memory bandwidth
(a thread-pool round trip per matrix, and oneDNN re-arranging plain weights on every call); the
native kernels run a whole MoE layer's experts in two passes at close to a plain read's speed
(bench/decode_limit.py measures both against the bandwidth; its figures are in bench/results).
They are built ahead of time, one library per instruction-set variant (library.py says how the
variant is chosen); where none can load (an install built without a compiler, an unknown CPU)
decode runs on transformers' kernels and the decode-path chooser says why.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from engine.decode.native import library
from engine.decode.native.library import Kernels


class _Loaded:
    """The kernels this process loaded (once), or why none."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.kernels: Kernels | None = None
        self.choice: library.Choice | None = None
        self.problem = ""

    def load(self) -> Kernels | None:
        with self.lock:
            if not self.done:
                try:
                    self.choice = library.choose()
                    if self.choice.variant is None:
                        self.problem = f"native decode kernels unavailable ({self.choice.problem})"
                    else:
                        self.kernels = Kernels(library.LIB_DIR / self.choice.variant.file, self.choice.variant)
                except (OSError, ValueError) as exc:
                    self.problem = f"native decode kernels unavailable ({str(exc).strip()[:200]})"
                self.done = True
            return self.kernels


_state = _Loaded()


def load() -> Kernels | None:
    """The kernels (loaded on first call, a few milliseconds), or None where none can run here."""
    return _state.load()


def ready() -> Kernels | None:
    """The kernels if they are loaded; None otherwise (never loads)."""
    return _state.kernels


def failed() -> bool:
    """Loading ended without kernels (none built, none for this CPU...)."""
    return _state.done and _state.kernels is None


def choice() -> library.Choice | None:
    """Which variant was chosen and why not a better one (after load())."""
    return _state.choice


def status() -> str:
    """One line for the user: the variant in use, or why none."""
    if _state.kernels is not None:
        variant = _state.kernels.variant
        forced = f", set by {library.VARIANT_ENV}" if _state.choice.forced else ""
        return f"native decode kernels: {variant.name} ({variant.label}){forced}"
    if _state.done:
        return _state.problem
    return "native decode kernels not loaded yet"


def why_not_better() -> list[str]:
    """For each better variant of this install, why it was not taken ("x86-64-v4-bf16: the CPU lacks avx512_bf16")."""
    if _state.choice is None:
        return []
    return [f"{variant.name}: {why}" for variant, why in _state.choice.passed_over]


def summary() -> str:
    """The variant in use for the user ("x86-64-v3: AVX2 and FMA"), or why none (loads them first)."""
    kernels = load()
    return f"{kernels.variant.name}: {kernels.variant.label}" if kernels is not None else _state.problem


def passed_over_text() -> str:
    """Why not a better variant, in one line ("" when the best of the install runs)."""
    reasons = why_not_better()
    return ("not " + "; not ".join(reasons)) if reasons else ""


def rows_beat_torch_bf16(kernels: Kernels) -> bool:
    """Whether a prompt's bf16 products are faster on `linear_rows`/`moe_prompt` than on torch: with
    the CPU's bf16 dot products, or where torch's bf16 matmul has no oneDNN kernel (no AVX-512 or
    AVX-NE-CONVERT) and falls back to a loop several times slower than float32, which the variant's
    float32 tiles are not. Elsewhere oneDNN's blocked bf16 kernels win."""
    return kernels.bf16_dot_products() or not _onednn_bf16()


def bf16_prompt_beats_torch(kernels: Kernels) -> bool:
    """Whether a bf16 model's whole prompt, experts included, is faster on the native rows than on
    transformers' kernels: where the rows beat torch's bf16 matmul, and beside AMX tiles only where
    the rows run on them too (oneDNN's bf16 kernels use the tiles)."""
    return rows_beat_torch_bf16(kernels) and (not amx_tiles() or kernels.amx())


@functools.cache
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def amx_tiles() -> bool:
    """The CPU has AMX tiles (Intel Sapphire Rapids and later), as torch's own probe says."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch 2.13: absent means no
    return bool(probe()) if probe is not None else False


def weight(kernels: Kernels, tensor: torch.Tensor, fmt=None, columns: int = 0) -> library.Weight:
    """A matrix as the kernels take it: a bf16 [rows, cols] tensor, or (with `fmt`, an
    engine.formats BlockFormat) a uint8 [rows, row bytes] tensor of its blocks and `columns`."""
    if fmt is None:
        return kernels.Weight(tensor, 0, tensor.shape[-1])
    return kernels.Weight(tensor, fmt.ggml_type, columns)


def slot_dequantizer(fallback):
    """A Dequantizer (engine.offload.expert_compute) that expands slots into bf16 or float32 with
    the native kernels once they are loaded, into the same values as the torch reference (tests hold
    the two equal bit for bit), and hands everything else to `fallback`: what a prefill or the exact
    path reads from quantized slots does not depend on whether the kernels are loaded. A float32
    model (the demo) needs this as much as a bf16 one: the torch reference is a dozen small ops per
    matrix, which for small experts cost more than the matmuls they feed."""

    def dequantize_into(packed: torch.Tensor, fmt, columns: int, out: torch.Tensor) -> None:
        kernels = _state.kernels
        if kernels is None or out.dtype not in (torch.bfloat16, torch.float32) or out.device.type != "cpu" or not out.is_contiguous():
            fallback(packed, fmt, columns, out)
            return
        kernels.dequantize(weight(kernels, packed.reshape(out.shape[0], -1), fmt, columns), out)

    return dequantize_into


def quantizer(fallback):
    """A Quantizer (engine.formats.quantize) that converts on the native kernels where they load,
    in every format they write (library.QUANTIZED_NATIVELY), into the bytes of the numpy reference
    (tests hold the two equal), and hands everything else to `fallback`: a conversion's files do not
    depend on whether the kernels are loaded. Loads the kernels (a conversion runs before decode
    would). bf16 and float32 tensors go in as they are, without a float32 numpy copy."""

    def quantize(matrix, fmt):
        kernels = load()
        if kernels is None or fmt.name not in library.QUANTIZED_NATIVELY:
            return fallback(matrix, fmt)
        x = matrix if isinstance(matrix, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(matrix))
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()  # fp16 (or float64) values: float32 holds them exactly (float64 as numpy rounds it)
        return kernels.quantize(x.detach().cpu(), fmt)

    return quantize
