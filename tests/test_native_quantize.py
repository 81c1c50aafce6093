"""The native quantizers (src/formats/quantize.h) write the bytes of the Python reference: the gguf
package's for Q8_0/Q4_0/Q5_0, engine/formats/quantize.py's numpy searches for the K-quants, on every
kernel variant this CPU runs; and a model converted through the runtime (which quantizes natively)
gets the files and the replies of the numpy conversion."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine.decode.native.library import QUANTIZED_NATIVELY, KernelError
from engine.formats.blocks import FORMATS, K_QUANTS
from engine.formats.dequantize import dequantize
from engine.formats.quantize import quantize, reference_quantizer

GGUF_OWN = ("q8_0", "q4_0", "q5_0")
SCALES = (1.0, 1e-8, 3e4)


def _matrix(scale: float, rows: int = 48, cols: int = 1024, seed: int = 0) -> np.ndarray:
    """Random rows with the awkward cases among them: all zero, constant, a zero block, one outlier,
    all of one sign, heavy tails, a few exact ties."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0] = 0.0
    x[1] = 0.25
    x[2, :256] = 0.0
    x[3, 7] = 60.0
    x[4] = np.abs(x[4])
    x[5] = -np.abs(x[5])
    x[6] *= np.exp(2 * rng.standard_normal(cols)).astype(np.float32)
    x[7, 256:512] = -1.5
    x[8] = np.round(x[8] * 4) / 4  # many equal values: ties in every argmax and rounding
    return (x * np.float32(scale)).astype(np.float32)


def _blocks(packed, fmt) -> np.ndarray:
    return np.asarray(packed).reshape(-1, fmt.block_bytes)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", GGUF_OWN)
def test_32_element_formats_are_the_gguf_packages_bytes(variant, name, scale):
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    fmt, x = FORMATS[name], _matrix(scale)
    expected = gguf_quants.quantize(x, GGMLQuantizationType(fmt.ggml_type))
    assert np.array_equal(_blocks(variant.quantize(torch.from_numpy(x), fmt), fmt), _blocks(expected, fmt))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quants_are_the_numpy_searches_bytes(variant, name, scale):
    # Bit for bit, not within a tolerance: the C++ forms every sum in numpy's order and dtype (float64
    # where numpy promotes int32 levels), so no tie can round another way; a differing block would
    # mean the two algorithms parted.
    fmt, x = FORMATS[name], _matrix(scale, seed=1)
    expected = _blocks(quantize(x, fmt), fmt)
    native = _blocks(variant.quantize(torch.from_numpy(x), fmt), fmt)
    differing = np.flatnonzero((expected != native).any(axis=1))
    assert differing.size == 0, f"{differing.size} of {len(expected)} blocks differ, first {differing[:5]}"


@pytest.mark.parametrize("name", [*GGUF_OWN, *K_QUANTS])
def test_the_round_trip_error_is_the_references(variant, name):
    fmt, x = FORMATS[name], _matrix(1.0, seed=2)
    native = variant.quantize(torch.from_numpy(x), fmt)
    back = dequantize(native, fmt, x.shape[1]).numpy()
    reference = dequantize(torch.from_numpy(np.ascontiguousarray(quantize(x, fmt))), fmt, x.shape[1]).numpy()
    assert np.array_equal(back, reference)
    normal = slice(9, None)  # the random rows: each format's error stays what its bits allow
    relative = np.sqrt(((back[normal] - x[normal]) ** 2).mean() / (x[normal] ** 2).mean())
    assert relative < {"q8_0": 0.01, "q6_k": 0.02, "q5_0": 0.05, "q4_0": 0.1, "q4_k": 0.1, "q3_k": 0.2,
                       "q2_k": 0.4}[name]


@pytest.mark.parametrize("name", ["q4_k", "q8_0"])
def test_bf16_rows_quantize_as_their_float32_values(variant, name):
    fmt = FORMATS[name]
    x = torch.from_numpy(_matrix(1.0, rows=12, seed=3)).bfloat16()
    assert torch.equal(variant.quantize(x, fmt), variant.quantize(x.float(), fmt))
    transposed = x.t().contiguous().t()  # a transposed expert's view: copied to rows first
    assert torch.equal(variant.quantize(transposed, fmt), variant.quantize(x.float(), fmt))


def test_bad_arguments_are_refused(variant):
    with pytest.raises(KernelError, match="whole number"):
        variant.quantize(torch.zeros(2, 48), FORMATS["q8_0"])
    with pytest.raises(KernelError, match="whole number"):
        variant.quantize(torch.zeros(2, 128), FORMATS["q4_k"])
    with pytest.raises(ValueError, match="mxfp4"):
        variant.quantize(torch.zeros(2, 64), FORMATS["mxfp4"])
    assert variant.quantize(torch.zeros(0, 256), FORMATS["q6_k"]).shape == (0, 210)
    assert set(QUANTIZED_NATIVELY) == {*GGUF_OWN, *K_QUANTS}


def test_the_quantizer_falls_back_for_what_the_kernels_do_not_write(kernels):
    from engine.decode.native import kernels as native

    calls: list[str] = []

    def fallback(matrix, fmt):
        calls.append(fmt.name)
        return reference_quantizer(matrix, fmt)

    quantizer = native.quantizer(fallback)
    x = _matrix(1.0, rows=12, seed=4)
    assert np.array_equal(np.asarray(quantizer(x, FORMATS["q4_k"])), quantize(x, FORMATS["q4_k"]))  # numpy in
    assert np.array_equal(np.asarray(quantizer(torch.from_numpy(x).half(), FORMATS["q3_k"])),
                          quantize(x.astype(np.float16), FORMATS["q3_k"]))  # fp16 values, widened
    assert calls == []
    assert np.array_equal(np.asarray(quantizer(x, FORMATS["mxfp4"])), quantize(x, FORMATS["mxfp4"]))
    assert calls == ["mxfp4"]


def test_a_conversion_through_the_runtime_writes_the_numpy_conversions_files(kernels, tmp_path, monkeypatch):
    """The runtime converts on the native kernels; with them swapped for the numpy reference, the
    experts' files, the dense blocks and the replies are the same."""
    from engine.decode.native import kernels as native
    from engine.model.dense_quantize import DenseCache, QuantizedLinear
    from tests.helpers.checkpoints import WIDE, greedy_reply, save_tiny_checkpoint

    path = save_tiny_checkpoint("qwen2_moe", tmp_path / "model", seed=11, **WIDE["qwen2_moe"])
    settings = dict(budget="all", store="ram", dtype="bfloat16", expert_format="q4_k", dense_format="q6_k")

    def convert() -> tuple[list[int], dict[str, bytes], dict[str, torch.Tensor]]:
        tokens, runtime = greedy_reply(path, [5, 17, 33, 8], 6, **settings)
        folder = runtime.layout.pieces[0][0][0].file.parent
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
        dense = {n: m.packed.clone() for n, m in runtime.model.named_modules() if isinstance(m, QuantizedLinear)}
        runtime.close()
        shutil.rmtree(folder)  # the next load converts again
        DenseCache.of(runtime.fingerprint, runtime.files.files, runtime.dtype, FORMATS["q6_k"]).path.unlink()
        return tokens, files, dense

    written: list[str] = []
    native_quantize = type(kernels).quantize

    def counted(self, x, fmt):
        written.append(fmt.name)
        return native_quantize(self, x, fmt)

    monkeypatch.setattr(type(kernels), "quantize", counted)
    tokens, files, dense = convert()
    assert {"q4_k", "q6_k"} <= set(written)  # the runtime did convert natively
    monkeypatch.setattr(native, "quantizer", lambda fallback: fallback)
    numpy_tokens, numpy_files, numpy_dense = convert()
    assert files.keys() == numpy_files.keys() and len(files) > 1
    assert all(files[name] == numpy_files[name] for name in files)
    assert dense.keys() == numpy_dense.keys() and dense
    assert all(torch.equal(dense[n], numpy_dense[n]) for n in dense)
    assert tokens == numpy_tokens
