"""llama.cpp from source, for side-by-side benchmarks: the tree vendored in the pinned
`llama-cpp-python` sdist (PyPI is the one index this project can always reach), built once with
CMake, CPU only, into the user cache folder and reused after.

    <cache>/llamacpp/<version>/source/   the sdist's vendor/llama.cpp (converter, gguf-py, CMake project)
    <cache>/llamacpp/<version>/build/    the CMake build; tools in build/bin/ (build-avx2/: --isa avx2),
                                         llama-server among them once a bench asks for it
    <cache>/llamacpp/<version>/gguf/     converted checkpoints (bench.gguf_files)

`MOESCOPE_LLAMACPP_DIR` replaces `<cache>/llamacpp` (tests point it at an existing build).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from engine.system.cpu import cpuinfo_field

VERSION = "0.3.36"  # llama-cpp-python; its vendored llama.cpp is what we build
TOOLS = ("llama-bench", "llama-quantize")  # what build_tools builds unless asked for more
SERVER = "llama-server"  # built on request (bench.serve_load), into the same build folder
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instruction set, as our own kernels get (-march=native)
    "-DGGML_OPENMP=ON",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained tools: nothing to find at run time
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # the server's targets configured (built only when asked for), its web UI left out: no npm, no download
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)


# x86 features GGML can be built for one by one, by the /proc/cpuinfo flag that says the CPU has it
GGML_X86_FEATURES = {"sse4_2": "GGML_SSE42", "f16c": "GGML_F16C", "fma": "GGML_FMA", "bmi2": "GGML_BMI2",
                     "avx": "GGML_AVX", "avx2": "GGML_AVX2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
                     "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                     "avx512_bf16": "GGML_AVX512_BF16"}


# Instruction sets llama.cpp can be built for: this CPU's, or AVX2 + FMA only (what a laptop without
# AVX-512 has, measured on a CPU that has more, beside MoEScope's avx2 kernel flavour)
ISAS = ("native", "avx2")
# the MoEScope kernel variant each --isa runs (native: the best this CPU runs)
ISA_VARIANT = {"native": "", "avx2": "x86-64-v3"}
BEYOND_AVX2 = ("avx512", "amx", "avx_vnni")  # flag prefixes an AVX2-only build leaves out


def hold_to_isa(parser: argparse.ArgumentParser, isa: str) -> None:
    """A bench's `--isa`: refused (through `parser`) on a CPU without it; else every MoEScope process
    started after this runs the kernel variant that matches it."""
    from engine.decode.native.library import VARIANT_ENV  # torch comes with it: only when asked

    if isa == "native":
        return
    if isa not in cpuinfo_field("flags").split():
        parser.error(f"--isa {isa} needs a CPU with {isa.upper()}; this one has not")
    os.environ[VARIANT_ENV] = ISA_VARIANT[isa]


def cmake_options(cpu_flags: set[str] | None = None, isa: str = "native") -> list[str]:
    """CMAKE_OPTIONS for this CPU. Where it has AMX, llama.cpp is built for its instruction set but
    AMX: in 0.3.36's tree the AMX matmul segfaults on our MoE GGUFs at the first prompt
    (ggml_backend_amx_mul_mat, a Sapphire Rapids VM, any load mode), and `--repack 0`, which avoids
    it, also drops the repacked AVX-512 layouts; this keeps those. `isa` avx2: this CPU's features
    up to AVX2, nothing of AVX-512, VNNI or AMX."""
    flags = set(cpuinfo_field("flags").split()) if cpu_flags is None else cpu_flags
    if isa == "avx2":
        flags = {f for f in flags if not f.startswith(BEYOND_AVX2)}
    elif "amx_int8" not in flags:
        return list(CMAKE_OPTIONS)
    features = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_X86_FEATURES.items()]
    no_amx = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return [o.replace("-DGGML_NATIVE=ON", "-DGGML_NATIVE=OFF") for o in CMAKE_OPTIONS] + features + no_amx


def build_target(isa: str = "native") -> str:
    """The instruction set llama.cpp is built for here, in words for the results."""
    if isa == "avx2":
        return "AVX2 and FMA only (no AVX-512, VNNI or AMX)"
    return "native" if "-DGGML_NATIVE=ON" in cmake_options() else "this CPU's x86 features but AMX"


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be fetched or built here; the message is one line for the user."""


def llamacpp_root() -> Path:
    if os.environ.get("MOESCOPE_LLAMACPP_DIR"):
        return Path(os.environ["MOESCOPE_LLAMACPP_DIR"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("moescope")) / "llamacpp"


@dataclass(frozen=True)
class LlamaCpp:
    """One version's folder: its source tree, build and converted files."""

    root: Path
    isa: str = "native"

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def build_dir(self) -> Path:
        return self.root / ("build" if self.isa == "native" else f"build-{self.isa}")

    @property
    def gguf_dir(self) -> Path:
        return self.root / "gguf"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def tool(self, name: str) -> Path:
        return self.build_dir / "bin" / name


def llamacpp(version: str = VERSION) -> LlamaCpp:
    return LlamaCpp(llamacpp_root() / version)


def ensure_source(version: str = VERSION) -> LlamaCpp:
    """The llama.cpp tree of the pinned sdist, downloaded and unpacked on first use."""
    lc = llamacpp(version)
    marker = lc.source / ".complete"
    if marker.exists():
        return lc
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(prefix="moescope-llamacpp-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise LlamaCppUnavailable(f"cannot download the llama-cpp-python {version} sdist from PyPI: {last}")
        (archive,) = Path(tmp).glob("*.tar.gz")
        shutil.rmtree(lc.source, ignore_errors=True)
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                if member.name.startswith(prefix):
                    member.name = member.name[len(prefix):]
                    members.append(member)
            tar.extractall(lc.source, members=members, filter="data")
    if not lc.converter.exists():
        raise LlamaCppUnavailable(f"the llama-cpp-python {version} sdist has no vendor/llama.cpp/convert_hf_to_gguf.py")
    marker.touch()
    return lc


def build_tools(version: str = VERSION, log=print, isa: str = "native", tools: tuple[str, ...] = TOOLS) -> LlamaCpp:
    """`tools` (llama-bench and llama-quantize unless told; SERVER too on request), built once (Release,
    native or `isa`, OpenMP, static) and reused; a tool asked for later is built into the same folder.

    The stamp holds the options; when they change, CMake reconfigures and rebuilds what they touch."""
    lc = replace(ensure_source(version), isa=isa)
    stamp = lc.build_dir / ".moescope-stamp"
    options = cmake_options(isa=isa)
    wanted = "\n".join(options)
    configured = stamp.exists() and stamp.read_text() == wanted
    missing = [t for t in tools if not lc.tool(t).exists()]
    if configured and not missing:
        return lc
    _check_toolchain()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = str(os.cpu_count() or 1)
    if missing:
        log(f"building llama.cpp {version} ({', '.join(missing)}) in {lc.build_dir}: several minutes, once")
    commands = [] if configured else [["cmake", "-S", str(lc.source), "-B", str(lc.build_dir), *generator, *options]]
    commands.append(["cmake", "--build", str(lc.build_dir), "--config", "Release", "-j", jobs, "--target", *tools])
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            (lc.build_dir / "moescope-build.log").write_text(proc.stdout + proc.stderr)
            raise LlamaCppUnavailable(f"`{' '.join(cmd[:2])}` failed for llama.cpp; the log is in "
                                      f"{lc.build_dir / 'moescope-build.log'}")
    stamp.write_text(wanted)
    return lc


def _check_toolchain() -> None:
    if not shutil.which("cmake"):
        raise LlamaCppUnavailable("building llama.cpp needs CMake (`cmake` is not on PATH; e.g. apt install cmake)")
    compilers = [c for c in ("c++", "g++", "clang++") if shutil.which(c)]
    if not compilers or not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        raise LlamaCppUnavailable("building llama.cpp needs a C and C++ compiler (none on PATH; e.g. apt install g++)")
