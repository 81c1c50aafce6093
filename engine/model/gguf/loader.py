"""Opening a GGUF file for offloaded inference: the model built from its metadata, dense weights
read from the file (kept in their blocks as `QuantizedLinear` where a kernel exists, else
dequantized with the `gguf` package), routed experts left in the file for the store.

llama.cpp's converter permutes the rows of Llama-style q/k projections for its RoPE kernel
(`LlamaModel.permute`); they are permuted back here, as transformers' own GGUF loader does. Rows are
quantized independently, so the permutation moves whole rows of blocks and works on them as on floats.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from engine.errors import CheckpointError
from engine.formats.blocks import FORMATS
from engine.model import experts_registry as experts_impl
from engine.model.checkpoint import CheckpointFiles, TensorRecord
from engine.model.dense_quantize import QuantizedLinear, dense_targets
from engine.model.dtypes import resolve_dtype
from engine.model.gguf import mla as gguf_mla
from engine.model.gguf.config import hf_config
from engine.model.gguf.convert import convert_experts
from engine.model.gguf.file import GGUFModel, open_gguf
from engine.model.gguf.layout import build_gguf_layout
from engine.model.loaded import LoadedWeights, ProgressFn, set_tensor, tie_loaded

PERMUTED = ("attn_q", "attn_k")  # llama.cpp's LlamaModel.permute: q with the query heads, k with the kv heads


def build_gguf_model(path: Path, *, device: torch.device, dtype: str = "auto", progress: ProgressFn | None = None,
                     load_dense: bool = True) -> LoadedWeights:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_model = open_gguf(path)
    config_dict = hf_config(gguf_model)
    compute_dtype = resolve_dtype(dtype, config_dict)
    experts_impl.register()
    kwargs = {k: v for k, v in config_dict.items() if k not in ("model_type", "dtype")}
    config = AutoConfig.for_model(config_dict["model_type"], **kwargs)
    with warnings.catch_warnings(), init_empty_weights(include_buffers=False):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype,
                                                 experts_implementation=experts_impl.IMPLEMENTATION_NAME)
    layout, conversions = build_gguf_layout(model, gguf_model, compute_dtype)
    files = CheckpointFiles(root=gguf_model.path, config=config_dict, tensors={
        t.name: TensorRecord(t.name, t.file, t.type_name, t.shape, t.offset, t.nbytes)
        for t in gguf_model.tensors.values()})
    for module_path in layout.module_paths:
        experts = model.get_submodule(module_path)
        for p in layout.params:
            setattr(experts, p.name, None)  # the bytes stay in the file; slots are the only copy
    notes: list[str] = []
    if not load_dense:
        return LoadedWeights(model, layout, files, compute_dtype, notes, gguf_model)
    notes += convert_experts(layout, gguf_model, conversions, progress=progress)
    _load_dense(model, layout, gguf_model, device, progress)
    model.to(device)  # non-persistent buffers (rotary tables) are created on the CPU
    model.eval().requires_grad_(False)
    return LoadedWeights(model, layout, files, compute_dtype, notes, gguf_model)


def _unpermute(rows: np.ndarray, gguf_name: str, config) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' GGUF loader does the same)."""
    stem = gguf_name.split(".")[-2]
    if stem not in PERMUTED:
        return rows
    heads = config.num_attention_heads if stem == "attn_q" else config.num_key_value_heads
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _load_dense(model: torch.nn.Module, layout, gguf_model: GGUFModel, device: torch.device,
                progress: ProgressFn | None) -> None:
    import gguf

    permute = gguf_model.architecture == "llama"
    text_config = model.config.get_text_config()
    linears = dict(dense_targets(model, set(layout.module_paths)))
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    total, done = max(1, layout.dense_bytes), 0
    for key, record in layout.dense.items():
        owner, _, leaf = key.rpartition(".")
        done += record.nbytes
        if key.endswith(gguf_mla.V_B):
            continue  # read with its first part
        raw = _read(record)
        fmt = FORMATS.get(record.dtype.lower())
        second = layout.dense.get(key + gguf_mla.V_B)
        if second is not None:  # MLA's kv_b_proj, split by the converter: joined, in floats
            values = gguf_mla.join_kv_b(_dequantize(raw, record, gguf), _dequantize(_read(second), second, gguf),
                                        text_config.num_attention_heads, text_config.kv_lora_rank)
            set_tensor(model, key, torch.from_numpy(values).to(device=device, dtype=state[key].dtype))
        elif leaf == "weight" and owner in linears and fmt is not None:  # kept in its blocks
            linear = linears[owner]
            packed = raw.reshape(linear.out_features, -1)
            if permute:
                packed = _unpermute(packed, record.name, text_config)
            module = QuantizedLinear(linear, fmt, torch.from_numpy(np.ascontiguousarray(packed)).to(device))
            parent, _, name = owner.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, module)
        elif key in state:
            target = state[key]
            values = _dequantize(raw, record, gguf)
            if values.size != target.numel():
                raise CheckpointError(f"{gguf_model.path.name}: tensor '{record.name}' has {values.size} values, the "
                                      f"model's '{key}' {tuple(target.shape)} needs {target.numel()}")
            values = values.reshape(tuple(target.shape))
            if permute and values.ndim >= 1:
                values = _unpermute(values, record.name, text_config)
            tensor = torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=target.dtype)
            set_tensor(model, key, tensor)
        if progress:
            progress(done / total, f"dense weights from {record.file.name}")
    tie_loaded(model)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{gguf_model.path.name} is missing {len(missing)} weights the model needs, e.g. "
                              f"'{missing[0]}'; the file is incomplete or of a variant MoEScope does not map")


def _read(record: TensorRecord) -> np.ndarray:
    return np.array(np.memmap(record.file, dtype=np.uint8, mode="r", offset=record.offset, shape=(record.nbytes,)))


def _dequantize(raw: np.ndarray, record: TensorRecord, gguf) -> np.ndarray:
    """float32 values of a GGUF tensor's bytes, through the `gguf` package."""
    if record.dtype == "F32":
        return raw.view(np.float32)
    if record.dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    if record.dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    qtype = gguf.GGMLQuantizationType[record.dtype]
    return np.asarray(gguf.quants.dequantize(raw.reshape(record.shape[0] if record.shape else 1, -1), qtype),
                      dtype=np.float32).reshape(-1)


def gguf_tokenizer(model: GGUFModel):
    """The tokenizer stored in a GGUF file (transformers converts it), or None when it has none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if "tokenizer.ggml.model" not in model.metadata:
        return None
    try:
        try:
            return AutoTokenizer.from_pretrained(model.path.parent, gguf_file=model.path.name)
        except (TypeError, ValueError):
            # AutoTokenizer parses the GGUF's config to pick a class, and with transformers 5.24 that fails
            # on gpt-oss's YaRN keys and refuses deepseek2; the generic fast tokenizer reads the same
            # vocabulary without it.
            return PreTrainedTokenizerFast.from_pretrained(model.path.parent, gguf_file=model.path.name)
    except Exception as exc:  # the tokenizers library raises bare Exceptions for a bad vocabulary
        raise CheckpointError(f"transformers cannot read the tokenizer in {model.path.name}: {exc}") from None
