"""MoEScope's weight formats in the benchmarks, each set against the llama.cpp type of the same bits.

`load_settings` is the one place a format name becomes MoEScope load settings. A name is
`<experts>` (dense weights in the same format, as llama.cpp's single-type GGUFs have them; `bf16`:
nothing quantized) or `<experts>-d<dense>` for mixed quantization, e.g. `q4_k-dq8_0` (4-bit
experts, 8-bit dense weights). llama.cpp's Q4_K_M keeps a few dense tensors at Q6_K, so `q4_k`
(all dense Q4_K) reads slightly fewer bytes a token than it, and `q4_k-dq6_k` slightly more.
`mxfp4` is llama.cpp's MXFP4_MOE (gpt-oss's format): MXFP4 experts, dense weights Q8_0 (its
default type for the other tensors), so its dense format is q8_0 unless named.
"""

from __future__ import annotations

from pathlib import Path

LLAMA_TYPE = {"bf16": "BF16", "q8_0": "Q8_0", "q4_k": "Q4_K_M", "q4_k-dq6_k": "Q4_K_M", "q4_k-dq8_0": "Q4_K_M",
              "mxfp4": "MXFP4_MOE"}
DENSE_OF = {"mxfp4": "q8_0"}  # experts-only llama.cpp types: the dense type they keep


class FormatNotAvailable(ValueError):
    """MoEScope cannot run this format (yet); the message is one line for the table."""


def _check(fmt: str) -> None:
    if fmt not in LLAMA_TYPE:
        raise FormatNotAvailable(f"unknown format {fmt!r} (known: {', '.join(LLAMA_TYPE)})")


def split_format(fmt: str) -> tuple[str | None, str | None]:
    """(expert format, dense format) of a bench format name; None: the checkpoint's own weights."""
    experts, _, dense = fmt.partition("-d")
    if experts == "bf16":
        return None, None
    return experts, dense or DENSE_OF.get(experts, experts)


def load_settings(fmt: str) -> dict:
    """The `LoadModel` fields that make MoEScope run `fmt`: bf16 compute, weights in the format."""
    _check(fmt)
    experts, dense = split_format(fmt)
    return {"dtype": "bfloat16"} | ({} if experts is None else {"expert_format": experts, "dense_format": dense})


def bytes_per_token(model_dir: Path, fmt: str) -> int:
    """Bytes of weights one decode token reads in `fmt` (the memory-bandwidth limit's numerator)."""
    _check(fmt)
    experts, dense = split_format(fmt)
    return active_bytes_per_token(model_dir, experts, dense)[0]


def active_bytes_per_token(model_dir: Path, expert_format: str | None = None,
                           dense_format: str | None = None) -> tuple[int, int, int]:
    """(bytes a decode token reads, expert bytes of those, one expert's bytes): every dense weight
    but the embedding table (one row), in `dense_format` where the engine would store it so, plus
    top-k experts per MoE layer in `expert_format`."""
    from engine.formats.blocks import format_for, parse_format
    from engine.model.dense_quantize import dense_targets
    from engine.model.inspect import inspect_checkpoint
    from engine.model.loader import build_model

    info = inspect_checkpoint(Path(model_dir), expert_format=parse_format(expert_format))
    loaded = build_model(str(model_dir), device=__import__("torch").device("meta"), load_dense=False)
    embed = loaded.model.get_input_embeddings().weight
    dense = info.dense_bytes - embed.numel() * embed.element_size()
    if (fmt := parse_format(dense_format)) is not None:  # what quantize_dense would store, layer by layer
        for _, linear in dense_targets(loaded.model, set(loaded.layout.module_paths)):
            if (chosen := format_for(fmt, linear.in_features)) is not None:
                weight = linear.weight
                dense -= weight.numel() * weight.element_size()
                dense += linear.out_features * linear.in_features // chosen.block * chosen.block_bytes
    experts = info.top_k * info.expert_bytes * info.num_moe_layers
    return dense + experts, experts, info.expert_bytes
