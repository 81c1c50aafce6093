"""The native kernels' sources stay laid out by concern: every header compiles on its own for every
variant's flags, includes form no cycle, no file grows past a reviewable size, and instruction-set
intrinsics stay in the files that name their instruction set."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "engine" / "decode" / "native" / "src"
HEADERS = sorted(p for p in SRC.rglob("*.h"))
SOURCES = sorted(p for p in SRC.rglob("*") if p.suffix in (".h", ".cpp"))
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# the widest and the narrowest variant of each architecture (CMakeLists.txt): the headers' ladders
# take their first and their last branch
TARGETS = {
    "x86-64-v4-bf16": ("x86_64", ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                                  "-mamx-int8"]),
    "x86-64-v2": ("x86_64", ["-march=x86-64-v2"]),
    "armv8.6-a-bf16": ("aarch64", ["-march=armv8.6-a+bf16+i8mm"]),
    "armv8-a": ("aarch64", ["-march=armv8-a"]),
}
MAX_LINES = 800


def _includes(path: Path) -> list[Path]:
    return [(path.parent / name).resolve() for name in INCLUDE.findall(path.read_text())]


def test_the_sources_are_there():
    assert len(HEADERS) > 20 and (SRC / "abi.cpp").is_file()


def test_no_source_file_grows_past_a_reviewable_size():
    long = {p.relative_to(SRC).as_posix(): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern: {long}"


def test_includes_form_no_cycle_and_name_files_that_exist():
    graph = {p.resolve(): _includes(p) for p in SOURCES}
    missing = [(p.name, q.name) for p, qs in graph.items() for q in qs if not q.is_file()]
    assert not missing
    state: dict[Path, int] = {}  # 1: on the current path, 2: done

    def visit(node: Path, path: list[Path]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cycle = [p.relative_to(SRC).as_posix() for p in [*path[path.index(nxt):], nxt]]
                pytest.fail(f"include cycle: {' -> '.join(cycle)}")
            if state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in graph:
        if state.get(node) is None:
            visit(node, [node])


def test_intrinsics_stay_in_the_files_of_their_instruction_set():
    # x86 intrinsics outside arch/x86 only in the few shared files that hold a vector type or a
    # vectorised helper for every width; NEON ones only in arch/arm and those shared files
    shared = {"base/simd.h", "base/scalar.h", "base/tune.h", "base/parallel.h", "base/features.h", "formats/blocks.h",
              "prompt/tiles.h", "prompt/int8.h", "prompt/experts.h", "prompt/linear.h", "attention/single.h"}
    for path in SOURCES:
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        if re.search(r"\b_mm(256|512)?_\w+\(", text) and not rel.startswith("arch/x86/"):
            assert rel in shared, f"{rel} uses x86 intrinsics outside arch/x86"
        if re.search(r"\bv\w+q_[sfu]\d+\(", text) and not rel.startswith("arch/arm/"):
            assert rel in shared, f"{rel} uses NEON intrinsics outside arch/arm"


def _compiler(arch: str) -> str | None:
    import platform

    native = "x86_64" if platform.machine() in ("x86_64", "AMD64") else platform.machine()
    if arch == native:
        return shutil.which("g++") or shutil.which("c++")
    return shutil.which(f"{arch}-linux-gnu-g++")


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_header_compiles_alone(target):
    from concurrent.futures import ThreadPoolExecutor

    arch, flags = TARGETS[target]
    compiler = _compiler(arch)
    if compiler is None:
        pytest.skip(f"no C++ compiler for {arch}")

    def compile_alone(header: Path) -> str:
        done = subprocess.run([compiler, "-std=c++17", "-fopenmp", "-fsyntax-only", *flags, "-I", str(SRC), "-x",
                               "c++", "-"], input=f'#include "{header.relative_to(SRC).as_posix()}"\n',
                              capture_output=True, text=True, check=False)
        return "" if done.returncode == 0 else f"{header.relative_to(SRC)}: {done.stderr.strip().splitlines()[0]}"

    with ThreadPoolExecutor(2) as pool:  # one translation unit per header, each from its own includes alone
        failures = [f for f in pool.map(compile_alone, HEADERS) if f]
    assert not failures, "\n".join(failures)
