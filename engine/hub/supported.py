"""Which model types the engine can run, derived from the installed transformers.

A family runs offloaded when its experts class carries `@use_experts_implementation` and it has a
causal-LM class. The decorator is found by reading the modeling sources (no imports: importing ~70
model modules would take seconds); the meta-model build in `estimate` is the final word per model.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

DECORATOR = "@use_experts_implementation"
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@cache
def supported_model_types() -> frozenset[str]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models_dir = Path(transformers.__file__).parent / "models"
    modules = {
        source.parent.name
        for source in models_dir.glob("*/modeling_*.py")
        if DECORATOR in source.read_text(encoding="utf-8", errors="ignore")
    }
    return frozenset(
        model_type
        for model_type in CONFIG_MAPPING_NAMES
        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type_to_module_name(model_type) in modules
    )


def is_supported_config(config: dict) -> bool:
    return str(config.get("model_type") or "") in supported_model_types()


def quantization_of(config: dict) -> str | None:
    """The checkpoint's quantization method (e.g. 'mxfp4', 'fp8'), or None for plain weights."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if isinstance(quant, dict):
        return str(quant.get("quant_method") or quant.get("format") or "quantized")
    return "quantized"


def checkpoint_quant(config: dict) -> str:
    """The weights' format from a config.json, in a word: its quantization (MXFP4, FP8) or its dtype (bf16)."""
    if quant := quantization_of(config):
        return quant.upper()
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    return SHORT_DTYPES.get(dtype, dtype)


# Quantized checkpoints the engine reads with their experts kept quantized (engine.model.prequantized).
RUNNABLE_QUANTIZATIONS = ("mxfp4", "fp8")


def quantization_problem(config: dict) -> str | None:
    """Why the engine cannot read this checkpoint's quantized weights; None for plain or readable ones."""
    quant = quantization_of(config)
    if quant is None:
        return None
    if quant not in RUNNABLE_QUANTIZATIONS:
        return f"{quant} quantized weights are not supported by MoEScope (it runs mxfp4 and block-wise fp8)"
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    if quant == "fp8" and (not block or len(block) != 2 or int(block[1]) != 128):
        return f"fp8 weights with weight_block_size {block} are not supported (MoEScope reads 128-column tiles)"
    return None


def config_problem(config: dict) -> str | None:
    """Why the engine cannot run a checkpoint with this config, from the config alone; None if it can."""
    model_type = config.get("model_type")
    if model_type not in supported_model_types():
        return f"model type '{model_type}' is not a mixture-of-experts family MoEScope runs"
    if problem := quantization_problem(config):
        return problem
    # auto_map alone is no problem here: supported types are built into transformers, whose own code
    # is used (engine.model.checkpoint refuses auto_map only for architectures transformers does not ship).
    return None
