"""The block formats: our quantizer writes GGUF's layouts, our dequantizer reads them back to the
very float32 values the `gguf` package's reference dequantizer gives, and the error of each format
is what its bits promise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.formats.blocks import FORMATS, QK_K, format_for, formats_that_fit, parse_format
from engine.formats.dequantize import dequantize
from engine.formats.quantize import quantize

# relative RMS error of a normal matrix, at most: what llama.cpp's reference quantizers reach too
ERROR = {"q8_0": 0.007, "q6_k": 0.022, "q5_0": 0.05, "q4_k": 0.08, "q4_0": 0.11, "q3_k": 0.17, "q2_k": 0.32,
         "mxfp4": 0.2}


def matrix(rows: int = 48, columns: int = 768, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)
    x[1] = 0.0  # an all-zero row
    x[2] = 0.013  # a constant row
    x[3, :256] = rng.standard_t(2, 256) * 0.05  # heavy tails
    x[4, 7] = 3.0  # one outlier
    x[5] = -np.abs(x[5])  # all negative: the min is the whole story
    return x


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_is_the_reference_dequantizer_bit_for_bit(name):
    fmt = FORMATS[name]
    x = matrix()
    packed = quantize(x, fmt)
    assert packed.shape == (x.shape[0], fmt.row_bytes(x.shape[1])) and packed.dtype == np.uint8
    reference = quants.dequantize(packed, GGMLQuantizationType(fmt.ggml_type)).reshape(x.shape)
    ours = dequantize(torch.from_numpy(packed), fmt, x.shape[1]).numpy()
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))
    # and into the compute dtype: the same values, rounded once
    bf16 = dequantize(torch.from_numpy(packed), fmt, x.shape[1], torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(reference).to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_slots_are_dequantized_on_their_own_device(name):
    # A GPU's cache dequantizes its slots where they are: no constant may be made on the CPU. The meta
    # device stands in for the GPU here (it refuses CPU operands just as CUDA does).
    fmt = FORMATS[name]
    packed = torch.zeros((3, fmt.row_bytes(2 * QK_K)), dtype=torch.uint8, device="meta")
    out = dequantize(packed, fmt, 2 * QK_K, torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (3, 2 * QK_K)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantization_error_is_what_the_bits_promise(name):
    fmt = FORMATS[name]
    x = matrix(rows=64, seed=1)[8:]  # normal rows only
    back = dequantize(torch.from_numpy(quantize(x, fmt)), fmt, x.shape[1]).numpy()
    error = np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean())
    assert error < ERROR[name], f"{name}: relative RMS error {error:.4f}"
    # edge rows come back exactly where the format can say them exactly
    edges = matrix()
    exact = dequantize(torch.from_numpy(quantize(edges, fmt)), fmt, edges.shape[1]).numpy()
    assert np.all(exact[1] == 0.0)


def test_format_names_sizes_and_fits():
    assert parse_format("4bit") is FORMATS["q4_k"] and parse_format("Q8_0") is FORMATS["q8_0"]
    assert parse_format("original") is None and parse_format(None) is None and parse_format("bf16") is None
    with pytest.raises(ValueError, match="unknown weight format 'q5'; choose one of: original, 8bit"):
        parse_format("q5")
    assert FORMATS["q4_k"].bits == 4.5 and FORMATS["q8_0"].bits == 8.5 and FORMATS["q2_k"].bits == 2.625
    assert FORMATS["mxfp4"].bits == 4.25
    assert FORMATS["q4_k"].packed_bytes((3, 512, 1024)) == 3 * 512 * 4 * 144
    assert formats_that_fit(1408) == ["q8_0", "q5_0", "q4_0", "mxfp4"]  # 1408 = 44 x 32: no whole 256-element super-blocks
    assert format_for(FORMATS["q4_k"], 1408).name == "q5_0" and format_for(FORMATS["q2_k"], 1408).name == "q4_0"
    assert format_for(FORMATS["q4_k"], 2048).name == "q4_k" and format_for(FORMATS["q4_k"], 100) is None
    assert set(formats_that_fit(2048)) == set(FORMATS)
    with pytest.raises(ValueError, match="not a whole number of 256-element blocks"):
        quantize(np.zeros((2, 100), dtype=np.float32), FORMATS["q4_k"])
