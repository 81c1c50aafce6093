"""The native kernels as an install carries them: built ahead of time, one library per instruction-set
variant, the best one the CPU runs chosen at run time, and no compiler needed to decode on them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.decode.native import library
from engine.formats.blocks import FORMATS, FP8
from tests.helpers.checkpoints import save_tiny_checkpoint

needs_kernels = pytest.mark.skipif(not library.variants(), reason="this install has no native kernels")


@needs_kernels
def test_the_libraries_are_built_from_the_sources_beside_them():
    # a checkout whose C++ changed since `pip install -e .` would test old kernels
    assert not library.sources_changed(), "the kernel sources changed since they were built: run pip install -e ."


def test_the_kernels_and_the_python_side_agree_on_every_block_format(kernels):
    for fmt in (*FORMATS.values(), FP8):
        assert kernels.format_traits(fmt.ggml_type) == (fmt.block, fmt.block_bytes), fmt.name
    assert kernels.format_traits(0) is None and kernels.format_traits(7) is None


@needs_kernels
def test_the_cpu_probe_reads_what_the_os_reports():
    features = library.cpu_features()
    assert features, "the probe found no features at all"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if flags:  # Linux names the same features the same way
        listed = set(next(line for line in flags.splitlines() if line.startswith(("flags", "Features"))).split())
        assert features <= listed | {"asimd"}, features - listed


@needs_kernels
def test_the_best_variant_this_cpu_runs_is_chosen(monkeypatch):
    monkeypatch.delenv(library.VARIANT_ENV, raising=False)
    choice = library.choose()
    features = library.cpu_features()
    assert choice.variant == library.runnable()[0]
    for passed, why in choice.passed_over:  # each better one names what the CPU lacks
        assert why.startswith("the CPU lacks ") and not set(passed.requires) <= features


def _install_copy(tmp_path: Path, extra_first: dict | None = None) -> Path:
    """This install's lib folder, with an imaginary best variant in front of its list."""
    lib = tmp_path / "lib"
    shutil.copytree(library.LIB_DIR, lib)
    built = library.manifest(lib)
    if extra_first:
        built["variants"].insert(0, extra_first)
    (lib / "variants.json").write_text(json.dumps(built))
    return lib


@needs_kernels
def test_a_variant_the_cpu_cannot_run_is_passed_over_and_named(tmp_path, monkeypatch):
    monkeypatch.delenv(library.VARIANT_ENV, raising=False)
    future = {"name": "x86-64-v9", "label": "an instruction set no CPU has", "file": "missing.so",
              "requires": ["made_up_feature"]}
    lib = _install_copy(tmp_path, future)
    choice = library.choose(lib)
    assert choice.variant is not None and choice.variant.name != "x86-64-v9"
    assert choice.passed_over[0][0].name == "x86-64-v9"
    assert choice.passed_over[0][1] == "the CPU lacks made_up_feature"


@needs_kernels
def test_the_variant_setting_picks_one_or_says_which_exist(monkeypatch):
    names = [v.name for v in library.variants()]
    slowest_runnable = library.runnable()[-1]
    monkeypatch.setenv(library.VARIANT_ENV, slowest_runnable.name)
    assert library.choose().variant == slowest_runnable
    monkeypatch.setenv(library.VARIANT_ENV, "avx1024")
    with pytest.raises(ValueError, match="avx1024 is not a variant of this install: use " + ", ".join(names)):
        library.choose()


def test_an_install_without_kernels_says_why(tmp_path):
    assert "no native kernels" in library.choose(tmp_path).problem  # no lib folder at all
    (tmp_path / "variants.json").write_text(json.dumps({"abi": 1, "variants": [],
                                                        "problem": "this install was built without a C++ compiler"}))
    assert library.choose(tmp_path).problem == "this install was built without a C++ compiler"


def _no_compiler_env(tmp_path: Path) -> dict[str, str]:
    """A user's machine without a compiler: a PATH with nothing on it, CC/CXX pointing nowhere, an
    empty cache folder."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "CC", "CXX"))}
    env.update(PATH=str(empty), CC="/nonexistent/cc", CXX="/nonexistent/c++", HOME=str(tmp_path),
               XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    return env


def _generate(model: Path, env: dict[str, str], *extra: str) -> dict:
    command = [sys.executable, "-m", "engine.cli.main", "generate", "--model", str(model), "--prompt-ids", "1,17,42,9",
               "--raw", "--max-new-tokens", "48", "--dtype", "bfloat16", "--budget", "all", "--json", *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@needs_kernels
def test_generate_decodes_on_the_native_kernels_with_no_compiler_reachable(tmp_path):
    model = save_tiny_checkpoint("mixtral", tmp_path / "model", hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    env = _no_compiler_env(tmp_path)
    fast = _generate(model, env)
    assert fast["decode_path"] == "fast: whole token in one native call", fast["decode_path_reason"]
    assert fast["kernels"]["variant"] == library.choose().variant.name
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so")), "something was built"
    # the same weights on transformers' kernels; their speeds are the benchmarks' to compare, side by side
    exact = _generate(model, env, "--exact")
    assert exact["decode_path"].startswith("exact")
    assert exact["decode_path_reason"].startswith("exact kernels were asked for")


CHECK = Path(__file__).resolve().parents[1] / "engine" / "decode" / "native" / "tests" / "check_arm64.sh"


@pytest.mark.kernels
@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64") and shutil.which("cmake")),
                    reason="needs Debian's g++-aarch64-linux-gnu and qemu-user (.ci/run installs them)")
def test_the_arm64_variants_hold_to_the_reference_under_qemu(tmp_path):
    # every arm64 variant cross-compiled, its dots and dequantization against the generic reference
    # on random blocks of every type, under emulation (correctness only); the base variant also on
    # a CPU model without dot products
    done = subprocess.run(["bash", str(CHECK), str(tmp_path / "arm64")], capture_output=True, text=True, timeout=1200,
                          check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    for variant in ("armv8.6_a_bf16", "armv8.2_a_dotprod", "armv8_a"):
        assert f"PASS libmoescope_kernels_{variant}.so" in done.stdout
    assert "PASS libmoescope_kernels_armv8_a.so (qemu -cpu cortex-a53)" in done.stdout


@pytest.mark.slow
def test_the_wheel_carries_every_variant_and_no_sources(tmp_path):
    # what `pip install moescope` on a machine without a compiler gets: the libraries of every
    # variant of the platform, the probe and their list, and none of the C++ sources
    import zipfile

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(root)],
                          capture_output=True, text=True, timeout=3600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = next(tmp_path.glob("moescope-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    lib = [n for n in names if n.startswith("engine/decode/native/lib/")]
    built = json.loads(zipfile.ZipFile(wheel).read("engine/decode/native/lib/variants.json"))
    assert {f"engine/decode/native/lib/{v['file']}" for v in built["variants"]} <= set(lib)
    assert f"engine/decode/native/lib/{built['probe']}" in lib
    assert len(built["variants"]) == len(library.variants())  # all of the platform's, as an editable install
    assert not [n for n in names if n.startswith("engine/decode/native/src/")]
