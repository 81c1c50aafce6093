"""Native one-token kernels for `--fast-decode` (moe_decode.cpp beside this file), built on first use.

torch's own kernels stream expert-sized bf16 weights at about half the memory bandwidth for one
row (a thread-pool round trip per matrix, and oneDNN re-arranging plain weights on every call);
the native kernels run a whole MoE layer's experts in two passes at close to a plain read's speed
(bench/decode_limit.py). They are compiled for this CPU (-march=native) by torch's extension
builder, which needs a C++ compiler and ninja, once per machine into the user cache; the build runs
on a background thread, and until it is ready (or where it cannot be built) decode tokens run on
transformers' kernels (the decode-path chooser says why), so nothing waits and nothing breaks
without a compiler.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import platformdirs
import torch

from engine.system.cpu import cpuinfo_field

SOURCE = Path(__file__).with_name("moe_decode.cpp")
HEADERS = tuple(Path(__file__).with_name(name) for name in ("quant.h", "quant_int.h", "prompt_int8.h", "prompt_fixed.h", "prompt_amx.h"))  # included by SOURCE: part of what a build is keyed by
# -march per build flavour: this CPU's best, AVX2 + FMA (laptops without AVX-512), and portable code
# the compiler vectorises for a baseline target (tests build each, tests/test_quant_kernels.py)
FLAVOURS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}
# Which flavour the engine builds and runs: native unless this names another, e.g. `avx2` to run, on
# an AVX-512 machine, what an AVX2-only laptop gets (bench.llamacpp --isa avx2 sets it)
FLAVOUR_ENV = "MOESCOPE_KERNEL_FLAVOUR"
LOAD_WAIT_S = 180.0  # a model loaded with fast decode waits this long for a build (usually well under)

_lock = threading.Lock()
_done = threading.Event()
_builder: threading.Thread | None = None
_kernels: ModuleType | None = None
_flavour = "native"  # the flavour _kernels were built as
_problem = ""  # why the kernels are unavailable, once a build failed


def _cpu_fingerprint() -> str:
    """What -march=native compiled for: a cached build must not run on a different CPU."""
    return platform.machine() + cpuinfo_field("flags")


def _cflags(flavour: str) -> list[str]:
    # -ffp-contract=off: a dequantized weight is a product then a difference, two roundings, as the
    # reference computes it; a fused multiply-add would round once (quant.h). MOESCOPE_TUNE_INTEL: the
    # prefetch hint and distance and MXFP4's kernel that measured faster on Intel cores (moe_decode.cpp).
    tune = ["-DMOESCOPE_TUNE_INTEL"] if cpuinfo_field("vendor_id") == "GenuineIntel" else []
    return ["-O3", FLAVOURS[flavour], "-ffp-contract=off", "-fopenmp", *tune]


def _build_name(flavour: str) -> str:
    code = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    digest = hashlib.sha256(code + torch.__version__.encode() + _cpu_fingerprint().encode() + flavour.encode()
                            + " ".join(_cflags(flavour)).encode())
    suffix = "" if flavour == "native" else f"_{flavour}"
    return f"moescope_decode_{digest.hexdigest()[:12]}{suffix}"


def compile_flavour(flavour: str = "native") -> ModuleType:
    """Build (or load the cached build of) one flavour of the kernels, now, on this thread."""
    from torch.utils import cpp_extension

    name = _build_name(flavour)
    directory = _directory_of(name)
    directory.mkdir(parents=True, exist_ok=True)
    with _only_builder(directory):
        return cpp_extension.load(
            name, [str(SOURCE)], build_directory=str(directory),
            extra_cflags=_cflags(flavour), extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def build_directory(flavour: str = "native") -> Path:
    return _directory_of(_build_name(flavour))


def _directory_of(name: str) -> Path:
    return Path(platformdirs.user_cache_dir("moescope")) / "kernels" / name


@contextmanager
def _only_builder(directory: Path) -> Iterator[None]:
    """Hold an OS lock on `directory` for a build or load of it (other processes wait; a process that
    dies mid-build releases it), and clear torch's own `lock` file while holding it: torch's builder
    takes that file even to load a finished build, and a process killed midway (the window closed
    during the first build, a CLI run that ended first) leaves it behind for every later one to wait on."""
    import fcntl

    with open(directory / ".moescope-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)  # no live build holds it: we hold the OS lock
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def requested_flavour() -> str:
    """The flavour FLAVOUR_ENV asks for (native when unset); ValueError naming the choices otherwise."""
    flavour = os.environ.get(FLAVOUR_ENV, "").strip() or "native"
    if flavour not in FLAVOURS:
        raise ValueError(f"{FLAVOUR_ENV}={flavour} is not a build flavour: use {', '.join(FLAVOURS)}")
    return flavour


def _build() -> None:
    global _kernels, _problem, _flavour
    try:
        _flavour = requested_flavour()
        _kernels = compile_flavour(_flavour)
    except Exception as exc:  # no compiler, no ninja, a failed build: decode keeps transformers' kernels
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _problem = f"native decode kernels unavailable ({first_line[:200]})"
    finally:
        _done.set()


def start_build() -> None:
    """Build (or load the cached build of) the kernels on a background thread; idempotent."""
    global _builder
    with _lock:
        if _builder is None:
            if platform.system() == "Windows":  # the build flags are GCC/Clang's
                _set_problem("native decode kernels are built for Linux and macOS only")
                return
            # Imported here, not on the thread (compile_flavour then finds it loaded): it pulls in
            # setuptools, and imports racing the main thread's (transformers' lazy modules) have
            # failed with ModuleNotFoundError.
            from torch.utils import cpp_extension  # noqa: F401

            try:  # the pip `ninja` package puts its binary beside the interpreter, not always on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass

            _builder = threading.Thread(target=_build, name="moescope-kernel-build", daemon=True)
            _builder.start()


def _set_problem(text: str) -> None:
    global _problem
    _problem = text
    _done.set()


def ready() -> ModuleType | None:
    """The kernels if they are built and loaded; None otherwise (never waits)."""
    return _kernels


def wait(timeout: float | None = None) -> ModuleType | None:
    """Start the build if needed and wait for it (tests, benchmarks); the kernels or None."""
    start_build()
    _done.wait(timeout)
    return _kernels


def failed() -> bool:
    """The build ended without kernels (no compiler, unsupported system...)."""
    return _done.is_set() and _kernels is None


def status() -> str:
    """One line for the user: ready, building, or why not."""
    if _kernels is not None:
        return "native decode kernels ready" + (f" ({_flavour} build, {FLAVOUR_ENV})" if _flavour != "native" else "")
    if _done.is_set():
        return _problem
    if _builder is not None:
        return "native decode kernels are building (first use on this machine)"
    return "native decode kernels not built yet"


def rows_beat_torch_bf16(kernels: ModuleType) -> bool:
    """Whether a prompt's bf16 products are faster on `linear_rows`/`moe_prompt` than on torch: with
    the CPU's bf16 dot products, or where torch's bf16 matmul has no oneDNN kernel (no AVX-512 or
    AVX-NE-CONVERT) and falls back to a loop several times slower than float32, which the build's
    float32 tiles are not. Elsewhere oneDNN's blocked bf16 kernels win."""
    return kernels.bf16_dot_products() or not _onednn_bf16()


def bf16_prompt_beats_torch(kernels: ModuleType) -> bool:
    """Whether a bf16 model's whole prompt, experts included, is faster on the native rows than on
    transformers' kernels: where the rows beat torch's bf16 matmul, and beside AMX tiles only where
    the rows run on them too (oneDNN's bf16 kernels use the tiles: a 128-token prompt ran 1.2-2.3x
    faster there than on the dot products, and 1.1-1.6x slower than on the rows' own tiles)."""
    return rows_beat_torch_bf16(kernels) and (not amx_tiles() or kernels.amx())


@functools.cache
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def amx_tiles() -> bool:
    """The CPU has AMX tiles (Intel Sapphire Rapids and later), as torch's own probe says."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch 2.13: absent means no
    return bool(probe()) if probe is not None else False


def weight(kernels: ModuleType, tensor: torch.Tensor, fmt=None, columns: int = 0):
    """A matrix as the kernels take it: a bf16 [rows, cols] tensor, or (with `fmt`, an
    engine.formats BlockFormat) a uint8 [rows, row bytes] tensor of its blocks and `columns`."""
    if fmt is None:
        return kernels.Weight(tensor, 0, tensor.shape[-1])
    return kernels.Weight(tensor, fmt.ggml_type, columns)


def slot_dequantizer(fallback):
    """A Dequantizer (engine.offload.expert_compute) that expands bf16 slots with the native
    kernels once they are built, into the same values as the torch reference (tests hold the two
    equal bit for bit), and hands everything else to `fallback`: what a prefill or the exact path
    reads from quantized slots does not depend on whether the kernels are ready."""

    def dequantize_into(packed: torch.Tensor, fmt, columns: int, out: torch.Tensor) -> None:
        kernels = _kernels
        if kernels is None or out.dtype != torch.bfloat16 or out.device.type != "cpu" or not out.is_contiguous():
            fallback(packed, fmt, columns, out)
            return
        kernels.dequantize(weight(kernels, packed.reshape(out.shape[0], -1), fmt, columns), out)

    return dequantize_into
