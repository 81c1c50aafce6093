"""Tiny MoE GGUF files and the folders LM Studio and Ollama keep them in, for the model library's tests.

The files are written with the `gguf` package's GGUFWriter and carry the metadata llama.cpp's
converter writes (`general.architecture`, `<arch>.block_count`, `<arch>.expert_count`, ...), with
small tensors in a real quant type, so header sizes are exact. Nothing here runs a model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

# widths a multiple of 256: the K-quants' block
HIDDEN, FFN, EXPERT_FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 256, 256, 4, 2, 16, 256


def write_moe_gguf(path: Path, *, arch: str = "qwen3moe", layers: int = 2, experts: int = 8, top_k: int = 2,
                   quant: str = "Q8_0", file_type: str | None = "MOSTLY_Q8_0", name: str = "Tiny MoE",
                   split_max_tensors: int = 0, vocabulary: int = 0, gating: int | None = None) -> Path:
    """A GGUF of `layers` MoE blocks with `experts` experts, expert matrices in `quant` ("F32": none).
    With `split_max_tensors`, a split set as llama.cpp's gguf-split writes it (`-00001-of-0000N.gguf`); with
    `vocabulary`, a tokenizer of that many tokens and merges in the metadata."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(top_k)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
    if gating is not None:  # gguf.ExpertGatingFuncType
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    if file_type is not None:
        writer.add_file_type(gguf.LlamaFileType[file_type])
    if vocabulary:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(vocabulary)])
        writer.add_token_types([1] * vocabulary)
        writer.add_token_merges([f"t{i} t{i + 1}" for i in range(vocabulary - 1)])
    rng = np.random.default_rng(0)

    def add(tensor: str, shape: tuple[int, ...], kind: str = "F32") -> None:
        data = rng.standard_normal(shape, dtype=np.float32)
        if kind == "F32":
            writer.add_tensor(tensor, data)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        try:
            packed = gguf.quants.quantize(data, qtype)
        except (gguf.quants.QuantError, NotImplementedError):  # no Python quantizer (K-quants): zero blocks
            packed = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
        writer.add_tensor(tensor, packed, raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN))
    add("output_norm.weight", (HIDDEN,))
    for b in range(layers):
        add(f"blk.{b}.attn_norm.weight", (HIDDEN,))
        add(f"blk.{b}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{b}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{b}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{b}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        add(f"blk.{b}.ffn_norm.weight", (HIDDEN,))
        if experts:
            add(f"blk.{b}.ffn_gate_inp.weight", (experts, HIDDEN))
            add(f"blk.{b}.ffn_gate_exps.weight", (experts, EXPERT_FFN, HIDDEN), quant)
            add(f"blk.{b}.ffn_up_exps.weight", (experts, EXPERT_FFN, HIDDEN), quant)
            add(f"blk.{b}.ffn_down_exps.weight", (experts, HIDDEN, EXPERT_FFN), quant)
        else:
            add(f"blk.{b}.ffn_gate.weight", (FFN, HIDDEN), quant)
            add(f"blk.{b}.ffn_up.weight", (FFN, HIDDEN), quant)
            add(f"blk.{b}.ffn_down.weight", (HIDDEN, FFN), quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path if not split_max_tensors else sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))[0]


def write_ollama_model(models: Path, gguf_file: Path, model: str, tag: str = "latest",
                       namespace: str = "library", registry: str = "registry.ollama.ai") -> Path:
    """Lay `gguf_file` out as `ollama pull` does: blobs/sha256-<hex> and a manifest naming it. Returns the blob."""
    data = gguf_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = models / "manifests" / registry / namespace / model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64,
                   "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 10},
        ],
    }))
    return blob
