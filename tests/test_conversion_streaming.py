"""Converting experts to a block format streams them: the files are the bytes `save_file` writes,
and the conversion's working memory does not grow with the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.formats.blocks import FORMATS
from engine.formats.quantize import quantized_tensor, reference_quantizer
from engine.model.loader import build_model
from engine.model.safetensors_writer import StreamedSafetensors
from engine.offload.quantized_store import quantize_layout
from engine.offload.store import DiskStore
from tests.helpers.checkpoints import save_tiny_checkpoint, write_large_qwen3_moe


def test_a_streamed_file_is_the_bytes_save_file_writes(tmp_path):
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32]
    tensors = {f"expert-{i * 7 % 23}.p{i}": (torch.randn((i % 4 + 1, i % 5), generator=gen) * 50).to(dtypes[i % 6])
               for i in range(40)}
    save_file(tensors, str(tmp_path / "reference.safetensors"))
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with StreamedSafetensors(tmp_path / "streamed.safetensors", specs, flush_bytes=64) as out:
        for name in reversed(list(tensors)):  # any order: each tensor has its place already
            out.write(name, tensors[name])
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_a_streamed_file_refuses_a_missing_or_misshapen_tensor(tmp_path):
    specs = {"a": (torch.uint8, (4,)), "b": (torch.bfloat16, (2, 2))}
    out = StreamedSafetensors(tmp_path / "x.safetensors", specs)
    with pytest.raises(ValueError, match="declared"):
        out.write("b", torch.zeros(4, dtype=torch.bfloat16))
    out.write("a", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="written twice"):
        out.write("a", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="never written"):
        out.close()


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_converted_layer_files_hold_each_experts_blocks_as_save_file_lays_them(tmp_path, fmt):
    # gpt-oss: transposed matrices and biases, the two kinds of tensor a layer file holds
    path = save_tiny_checkpoint("gpt_oss", tmp_path / "gpt-oss", intermediate_size=64)
    layout = build_model(path, device=torch.device("cpu"), load_dense=False).layout
    converted, _ = quantize_layout(layout, FORMATS[fmt], "fingerprint", root=tmp_path / "cache")
    source = DiskStore(layout)
    slot = torch.empty(layout.slot_bytes, dtype=torch.uint8)
    original = {p.name: p for p in layout.params}
    for layer in range(layout.num_layers):
        file = converted.pieces[layer][0][0].file
        tensors = load_file(str(file))
        save_file(tensors, str(tmp_path / "resaved.safetensors"))
        assert file.read_bytes() == (tmp_path / "resaved.safetensors").read_bytes()
        for expert in range(layout.num_experts):
            source.fill(layer, expert, slot)
            for p in converted.params:
                o = original[p.name]
                value = slot[o.offset : o.offset + o.nbytes].view(o.dtype).view(o.shape)
                if p.fmt is not None:
                    value = quantized_tensor(value.t() if p.transposed else value, p.fmt, reference_quantizer)
                assert torch.equal(tensors[f"expert-{expert}.{p.name}"], value.reshape(tensors[f"expert-{expert}.{p.name}"].shape))
    source.close()


# Runs in its own process, so that VmHWM is the conversion's: the peak above the memory resident
# before it, once the layout is read and the quantizer's kernels are loaded.
PEAK_SCRIPT = """
import json, sys, torch
from pathlib import Path
from engine.decode.native import kernels as native
from engine.formats.blocks import FORMATS
from engine.formats.quantize import quantized_tensor, reference_quantizer
from engine.model.loader import build_model
from engine.offload.quantized_store import quantize_layout
from engine.system import memory

layout = build_model(Path(sys.argv[1]), device=torch.device("cpu"), load_dense=False).layout
fmt, quantizer = FORMATS["q8_0"], native.quantizer(reference_quantizer)
quantized_tensor(torch.zeros(64, 512, dtype=torch.bfloat16), fmt, quantizer)
memory.release_free_heap()
before = memory.rss_bytes()
memory.reset_phase_peak()
quantize_layout(layout, fmt, "fingerprint", root=Path(sys.argv[2]), quantizer=quantizer)
print(json.dumps({"working_bytes": memory.phase_peak_rss_bytes() - before}))
"""
GROWTH_BOUND = 8 * 2**20  # what twice the experts may add; a layer held whole would add 27 MiB


@pytest.mark.process
def test_conversion_working_memory_does_not_grow_with_the_model(tmp_path):
    # one layer of 32 or of 64 experts, 1.5 MiB each in bf16: in Q8_0 the layer is 27 or 53 MiB
    runs = []
    for experts in (32, 64):
        model = write_large_qwen3_moe(tmp_path / f"e{experts}", layers=1, experts=experts, hidden=512,
                                      expert_intermediate=512, vocab=256)
        runs.append(subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, str(model), str(tmp_path / f"c{experts}")],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    working = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        working.append(json.loads(out.strip().splitlines()[-1])["working_bytes"])
    small, large = working
    assert large - small < GROWTH_BOUND, f"{small / 2**20:.1f} MiB -> {large / 2**20:.1f} MiB"
    assert large < 2 * GROWTH_BOUND  # a few experts' worth at a time, not a layer's
    assert len(list(Path(tmp_path / "c64").rglob("*.safetensors"))) == 1


def test_a_load_never_expands_a_quantized_lm_head(tmp_path, monkeypatch):
    """Asking whether the LM head shares the embedding must not read its `weight`: on a quantized head
    that expands the whole matrix, a vocabulary's worth of temporaries at load (2.6 GiB peak for
    0.9 GiB resident on the 9.4 GB bench.memcap shape)."""
    from engine.decode.runtime import MoERuntime
    from engine.model.dense_quantize import QuantizedLinear
    from engine.protocol import LoadModel

    path = save_tiny_checkpoint("mixtral", tmp_path / "mixtral", intermediate_size=64)
    expanded = []
    weight = QuantizedLinear.weight
    monkeypatch.setattr(QuantizedLinear, "weight", property(lambda self: expanded.append(self) or weight.fget(self)))
    runtime = MoERuntime(LoadModel(path=str(path), budget="all", store="disk", device="cpu", dtype="bfloat16",
                                   dense_format="q8_0", warm=False))
    try:
        head = runtime.model.get_output_embeddings()
        assert isinstance(head, QuantizedLinear) and head not in expanded
    finally:
        runtime.close()
