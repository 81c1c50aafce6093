"""Dense weights in a block format (mixed quantization: experts in one format, the rest in another).

Every plain linear layer of the model — attention projections, shared experts, dense MLPs, the LM
head — may be stored in a block format, except the routers (a few rows that decide which experts
run: kept as they are), an LM head tied to the embedding, and MLA's `kv_b_proj` (DeepSeek), which
the absorbed one-token attention (engine.decode.modules.latent_attention) reads per head as a matrix:
quantized, every token would dequantize it whole. Each becomes a `QuantizedLinear`
holding only its blocks; its forward computes with the dequantized weight (the reference values),
and the native decode paths read the blocks directly. A conversion is cached in MoEScope's cache
folder like the experts' (engine.offload.quantized_store), so only a model's first load in a format
pays for the quantizer's searches.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.formats.blocks import BlockFormat, format_for
from engine.formats.dequantize import Dequantizer, reference_dequantizer
from engine.formats.quantize import Quantizer, quantized_tensor, reference_quantizer
from engine.model.conversion_cache import SOURCES, Sources, conversion_name, quantized_root, room_for, sources_of, sync
from engine.model.dtypes import dtype_name
from engine.model.layout import ROUTER_NAMES
from engine.system.progress import ProgressFn

KEPT_AS_IS = ("kv_b_proj",)  # see the module's docstring


class QuantizedLinear(torch.nn.Module):
    """A linear layer whose [out, in] weight is stored as blocks of `fmt` (uint8 [out, row bytes])."""

    def __init__(self, linear: torch.nn.Linear, fmt: BlockFormat, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt, self.dtype = fmt, linear.weight.dtype
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias
        self.dequantizer: Dequantizer = reference_dequantizer  # the runtime may give a faster one, same values

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in the compute dtype (made on each access: for code that asks)."""
        out = torch.empty((self.out_features, self.in_features), dtype=self.dtype, device=self.packed.device)
        self.dequantizer(self.packed, self.fmt, self.in_features, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.device), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


def dense_targets(model: torch.nn.Module, expert_modules: set[str]) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers a dense format applies to, by name: not inside an experts module, not a
    router, not MLA's kv_b_proj, not an LM head that shares the embedding's weight."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    targets = []
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name.rpartition(".")[2] in (*ROUTER_NAMES, *KEPT_AS_IS):
            continue
        if any(name.startswith(path + ".") for path in expert_modules):
            continue
        if embedding is not None and module.weight is embedding:
            continue
        targets.append((name, module))
    return targets


@dataclass(frozen=True)
class DenseCache:
    """Where a model's dense conversion to one format is kept, and the files it comes from."""

    path: Path
    sources: Sources

    @classmethod
    def of(cls, fingerprint: str, files: list[Path], dtype: torch.dtype, fmt: BlockFormat) -> DenseCache:
        sources = sources_of(files)
        return cls(quantized_root() / f"{conversion_name(fingerprint, sources, dtype_name(dtype), 'dense-' + fmt.name)}"
                                      ".safetensors", sources)


def quantize_dense(model: torch.nn.Module, fmt: BlockFormat, expert_modules: set[str],
                   cache: DenseCache | None = None, progress: ProgressFn | None = None,
                   quantizer: Quantizer = reference_quantizer) -> list[str]:
    """Replace the dense linear layers by `QuantizedLinear`s in `fmt` (llama.cpp's fallback format
    for narrow ones, as for experts); returns notes for the user. With a `cache`, the blocks of an
    earlier load are read back from it instead of quantizing again, and a new conversion is
    written there (atomically; a cache that cannot be written costs only the reuse). `quantizer`:
    the runtime passes the native one (the same bytes)."""
    targets = [(name, module, format_for(fmt, module.in_features)) for name, module in dense_targets(model, expert_modules)]
    wanted = {name: (chosen, (module.out_features, chosen.row_bytes(module.in_features)))
              for name, module, chosen in targets if chosen is not None}
    formats = {name: chosen.name for name, (chosen, _) in wanted.items()}
    stored = _read_cached(cache.path, wanted, formats) if cache is not None else None
    if progress is not None:
        progress(1.0, f"dense weights in {fmt.label} from the cache" if stored is not None
                 else f"converting dense weights to {fmt.label}")
    fallbacks: dict[str, list[str]] = {}
    kept: list[str] = []
    converted: dict[str, torch.Tensor] = {}
    for name, module, chosen in targets:
        if chosen is None:
            kept.append(name)
            continue
        if stored is not None:
            packed = stored[name]
        else:
            packed = converted[name] = quantized_tensor(module.weight.detach().cpu(), chosen, quantizer)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf,
                QuantizedLinear(module, chosen, packed.to(module.weight.device)))
        if chosen is not fmt:
            fallbacks.setdefault(chosen.name, []).append(name)
    notes = [f"{len(names)} dense weights whose input features are not whole {fmt.block}-element blocks are stored "
             f"as {name} instead of {fmt.name}, as llama.cpp's quantizer does (e.g. '{names[0]}')"
             for name, names in fallbacks.items()]
    if kept:
        notes.append(f"{len(kept)} dense weights no block format fits stay in the original dtype (e.g. '{kept[0]}')")
    if cache is not None and converted:
        notes += _write_cache(cache, converted, formats)
    return notes


def _read_cached(path: Path, wanted: dict[str, tuple[BlockFormat, tuple[int, int]]],
                 formats: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """The blocks of an earlier conversion, or None unless the file holds exactly the wanted
    tensors in the wanted formats and shapes (a truncated or foreign file is never trusted)."""
    try:
        with safe_open(path, framework="pt") as handle:
            written = json.loads((handle.metadata() or {}).get("formats", "{}"))
            if set(handle.keys()) != set(wanted) or written != formats:
                return None
            tensors = {name: handle.get_tensor(name) for name in wanted}
    except (OSError, ValueError, SafetensorError):
        return None
    if any(tensors[name].dtype != torch.uint8 or tuple(tensors[name].shape) != shape
           for name, (_, shape) in wanted.items()):
        return None
    return tensors


def _write_cache(cache: DenseCache, tensors: dict[str, torch.Tensor], formats: dict[str, str]) -> list[str]:
    path = cache.path
    partial = path.with_name(path.name + ".partial")
    needed = sum(t.numel() for t in tensors.values())
    try:
        fits, free, _ = room_for(path.parent, needed)
        if not fits:
            return [f"the dense weights were converted but not cached ({needed / 2**30:.2f} GiB needed in "
                    f"{path.parent}, {free / 2**30:.2f} GiB free): the next load converts them again"]
        save_file(tensors, str(partial), metadata={"formats": json.dumps(formats), SOURCES: json.dumps(cache.sources)})
        sync(partial)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        return [f"the dense weights were converted but not cached ({exc.strerror or exc} in {path.parent}): "
                "the next load converts them again"]
    return []
