"""A GGUF file's size estimate from its header alone: architecture, experts, bytes in its own quant types.

The header is parsed with `engine.model.gguf.header` (metadata and tensor table, quant types from the `gguf`
package); no tensor bytes are read, so a 100 GiB file is sized in a fraction of a second. Expert tensors are llama.cpp's fused
`blk.N.ffn_{gate,up,down}_exps` (and their biases); everything else is dense. Sizes are the file's
own bytes: the estimate says what the experts and dense weights take as the file stores them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.errors import CheckpointError
from engine.hub.estimate import SizeEstimate
from engine.model.gguf.config import ARCHITECTURES, SUPPORTED, unmapped_variant
from engine.model.gguf.file import split_parts as model_split_parts
from engine.model.gguf.header import BadHeader, ParsedHeader, ShortHeader, read_file_header

BLOCK = re.compile(r"^blk\.(\d+)\.")
# GGUF architectures the GGUF loader maps onto a transformers MoE family: the loader's own table
GGUF_ARCHITECTURES = {arch: model_type for arch, (model_type, _) in ARCHITECTURES.items()}
WORKING = SUPPORTED
KV_ITEMSIZE = 2  # the KV cache is kept in bf16


@dataclass
class GGUFHeader:
    """What the header of a GGUF file (or split set) says, for the library."""

    path: Path  # the first file
    parts: list[Path]
    architecture: str
    name: str  # general.name, else the file name
    quant: str  # the file type ("Q4_K_M"), else the experts' most common tensor type
    file_bytes: int
    metadata: dict[str, object] = field(default_factory=dict)
    tensors: list[tuple[str, str, int, int]] = field(default_factory=list)  # name, type, elements, bytes

    def arch_value(self, key: str, default=None):
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def expert_count(self) -> int:
        return int(self.arch_value("expert_count", 0) or 0)


class GGUFProblem(CheckpointError):
    """A GGUF file that cannot be read: one line naming the file."""


def split_parts(path: Path) -> list[Path]:
    """Every file of the split set `path` starts (just `path` when not split); names the missing part."""
    try:
        return model_split_parts(path)
    except CheckpointError as exc:
        raise GGUFProblem(str(exc)) from None


def read_header(path: Path) -> GGUFHeader:
    """The header of a GGUF file (every part of a split set); GGUFProblem on a broken file."""
    parts = split_parts(path)
    return header_of(parts, [_read_part(part) for part in parts], [part.stat().st_size for part in parts])


def header_of(parts: list[Path], parsed: list[ParsedHeader], sizes: list[int]) -> GGUFHeader:
    """Put the parsed parts of one model together (the first part holds the metadata) and check that every
    tensor's bytes lie inside its file."""
    tensors = []
    for part, header, size in zip(parts, parsed, sizes, strict=True):
        for name, kind, elements, nbytes, end in header.tensors:
            if end > size:
                raise GGUFProblem(f"{part} is truncated: tensor '{name}' ends past the end of the file; download "
                                  "it again")
            tensors.append((name, kind, elements, nbytes))
    metadata = parsed[0].metadata
    architecture = str(metadata.get("general.architecture") or "")
    if not architecture:
        raise GGUFProblem(f"{parts[0]} has no general.architecture in its metadata; it was not written by llama.cpp")
    return GGUFHeader(parts[0], parts, architecture, str(metadata.get("general.name") or parts[0].stem),
                      _quant_label(metadata, tensors), sum(sizes), metadata, tensors)


def _read_part(part: Path) -> ParsedHeader:
    try:
        return read_file_header(part)
    except ShortHeader:
        raise GGUFProblem(f"{part} is truncated inside its header; download it again") from None
    except BadHeader as exc:
        raise GGUFProblem(f"{part} is not a readable GGUF file: {exc}; download it again") from None


def _quant_label(metadata: dict, tensors: list[tuple[str, str, int, int]]) -> str:
    import gguf

    file_type = metadata.get("general.file_type")
    if file_type is not None:
        try:
            return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    counts: dict[str, int] = {}
    for name, kind, _, nbytes in tensors:
        if "_exps" in name:
            counts[kind] = counts.get(kind, 0) + nbytes
    return max(counts, key=counts.get) if counts else ""  # type: ignore[arg-type]


def searchable_gguf(architecture: str, repo_id: str) -> bool:
    """A Hub GGUF repo of a family the loader maps. The Hub's GGUF summary does not say whether a `llama`
    file has experts, so `llama` counts only when the repo's name says Mixtral."""
    if architecture == "llama":
        return "mixtral" in repo_id.lower()
    return architecture in GGUF_ARCHITECTURES


def gguf_problem(header: GGUFHeader) -> str | None:
    """Why the engine cannot run this GGUF, from its header; None when the loader maps it."""
    if header.architecture not in GGUF_ARCHITECTURES:
        return (f"GGUF architecture '{header.architecture}' cannot be mapped to a model MoEScope runs; "
                f"GGUF architectures that work: {WORKING}")
    variant = unmapped_variant(header.architecture, header.arch_value, (name for name, *_ in header.tensors))
    return f"{header.path.name} is {variant}" if variant else None


def estimate_gguf(header: GGUFHeader) -> SizeEstimate:
    """Sizes in the file's own bytes: one expert's slot is its share of each fused expert tensor."""
    from engine.model.layout import aligned

    experts = header.expert_count
    moe_layers: dict[int, int] = {}  # block -> one expert's slot bytes
    expert_elements = expert_bytes = total_elements = dense_bytes = embedding = 0
    for name, _, elements, nbytes in header.tensors:
        total_elements += elements
        block = BLOCK.match(name)
        if "_exps" in name and block and experts:
            expert_elements += elements
            expert_bytes += nbytes
            layer = int(block.group(1))
            moe_layers[layer] = moe_layers.get(layer, 0) + aligned(nbytes // experts)
        else:
            dense_bytes += nbytes
            if name == "token_embd.weight":
                embedding = elements
    slot = aligned(max(moe_layers.values(), default=0))
    top_k = int(header.arch_value("expert_used_count", 0) or 0)
    layers = int(header.arch_value("block_count", 0) or 0)
    per_expert = expert_elements // (experts * len(moe_layers)) if moe_layers else 0
    problem = gguf_problem(header)
    if not moe_layers and problem is None:
        problem = "a dense model, not a mixture-of-experts model; MoEScope offloads experts"
    return SizeEstimate(
        model_type=GGUF_ARCHITECTURES.get(header.architecture, header.architecture),
        architecture=f"GGUF {header.architecture}",
        num_layers=layers,
        num_moe_layers=len(moe_layers),
        num_experts=experts,
        top_k=top_k,
        total_params=total_elements,
        expert_params=expert_elements,
        dense_params=total_elements - expert_elements,
        active_params=total_elements - expert_elements + top_k * per_expert * len(moe_layers),
        embedding_params=embedding,
        dtype="bfloat16",  # what the engine computes in; the bytes below are the file's own
        bytes_per_param=KV_ITEMSIZE,
        dense_bytes=dense_bytes,
        expert_bytes=expert_bytes,
        bytes_per_expert=slot,
        all_expert_bytes=slot * experts * len(moe_layers),
        min_budget_bytes=slot * top_k * len(moe_layers),
        kv_bytes_per_token=_kv_bytes_per_token(header),
        download_bytes=header.file_bytes,
        quantization=f"GGUF {header.quant}" if header.quant else "GGUF",
        problem=problem,
        notes=[f"sizes are the GGUF file's own bytes ({header.quant or 'its tensor types'}), read from its header"],
    )


def _number(value) -> int:
    """A metadata count; per-layer arrays (some architectures vary heads by layer) count their largest."""
    if isinstance(value, list):
        return max((int(v) for v in value), default=0)
    return int(value or 0)


def _kv_bytes_per_token(header: GGUFHeader) -> int:
    layers = _number(header.arch_value("block_count"))
    heads = _number(header.arch_value("attention.head_count"))
    if not layers or not heads:
        return 0
    kv_heads = _number(header.arch_value("attention.head_count_kv")) or heads
    hidden = _number(header.arch_value("embedding_length"))
    key = _number(header.arch_value("attention.key_length")) or hidden // heads
    value = _number(header.arch_value("attention.value_length")) or key
    return layers * kv_heads * (key + value) * KV_ITEMSIZE


def scaled_estimate(est: SizeEstimate, size: int, label: str, base_label: str) -> SizeEstimate:
    """Another quant file of the same model, sized from `est` (one file's header) by the ratio of file sizes:
    the same tensors, in other types. Exact once that file is here and its own header is read."""
    from engine.accounting.sizes import format_bytes
    from engine.model.layout import aligned

    ratio = size / max(est.download_bytes or 1, 1)
    slot = aligned(int(est.bytes_per_expert * ratio))
    return replace(est, dense_bytes=int(est.dense_bytes * ratio), expert_bytes=int(est.expert_bytes * ratio),
                   bytes_per_expert=slot, all_expert_bytes=slot * est.num_experts * est.num_moe_layers,
                   min_budget_bytes=slot * est.top_k * est.num_moe_layers, download_bytes=size,
                   quantization=f"GGUF {label}",
                   notes=[f"sized from the {base_label} file's header, scaled to this file's "
                          f"{format_bytes(size)}; exact once downloaded"])
