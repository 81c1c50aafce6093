"""Every MoE family in the installed transformers, as a tiny random checkpoint.

The families are found by introspection: every experts class whose forward is the one
`@use_experts_implementation` installs. A new transformers release's family appears here by
itself. Each family's config class is built from its own defaults (the full-size model), shrunk
by rules on field names, plus a small table of per-family overrides where the rules cannot
guess, then saved with `save_pretrained` (in the checkpoint naming transformers writes).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.helpers.checkpoints import VOCAB, make_tokenizer

LAYERS = 3  # enough for a dense first layer plus two MoE layers
EXPERTS = 8
TOP_K = 2

# Field name -> tiny value. A field is shrunk only when its default is a larger positive int.
EXACT_RULES: dict[str, int] = {
    "vocab_size": VOCAB, "max_position_embeddings": 256, "max_window_layers": LAYERS,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS, "depth": 1,
    "num_attention_heads": 4, "num_heads": 4, "n_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2,
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "moe_top_k": TOP_K, "top_k": TOP_K, "moe_topk": TOP_K, "top_k_experts": TOP_K,
    "num_experts_per_token": TOP_K, "moe_k": TOP_K,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 2, "num_expert_group": 2, "n_groups": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "sliding_window": 64, "hidden_size_per_layer_input": 8,
}
# Suffix -> tiny value, for the fields the exact names miss (vision towers, linear attention, ...).
SUFFIX_RULES: tuple[tuple[str, int], ...] = (
    ("intermediate_size", 32), ("ffn_hidden_size", 32), ("ffn_dim", 32),
    ("hidden_size", 32), ("head_dim", 8), ("d_model", 32), ("output_dim", 32), ("out_dim", 32), ("in_dim", 32),
    ("decoder_dim", 32), ("input_size", 32), ("output_size", 32), ("_heads", 4), ("d_state", 16), ("state_size", 16),
)

# Per-family fields the rules cannot guess (model_type -> fields of the top config; a nested dict
# sets fields of that sub-config). Keep this small, and say why for each.
OVERRIDES: dict[str, dict] = {
    # experts every 2nd layer from layer 1, attention every 8th from 4: 3 layers would have no attention
    "jamba": dict(attn_layer_period=2, attn_layer_offset=0),
    # the default config is a dense model (1 expert) and leaves head_dim unset, which the attention needs
    "hunyuan_v1_moe": dict(num_experts=EXPERTS, moe_topk=TOP_K, head_dim=8),
    # the default config leaves layer_types unset, which the decoder layers index
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    # the default config leaves top-k unset
    "deepseek_v2": dict(num_experts_per_tok=TOP_K),
    # the default config leaves the experts unset
    "dots1": dict(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1),
    # the default text config leaves top-k and which layers are sparse unset
    "deepseek_ocr2": dict(text_config=dict(num_experts_per_tok=TOP_K, mlp_layer_types=["dense", "sparse", "sparse"])),
    # the default config is all Mamba layers, which transformers' generate cannot run (no attention cache)
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                             mamba_n_heads=4, mamba_d_head=16),
    # the rotary sections default to a 128-wide head (partial rotary 0.5); the tiny one rotates 2 frequencies
    "glm4v_moe": dict(text_config=dict(rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5,
                                                           rope_type="default", mrope_section=[1, 1, 0]))),
    # Mamba heads x head size must equal the Mamba expansion of the hidden size (2 x 32)
    # the rotary part is head_dim x partial_rotary_factor (0.5), which must be the MLA rope size (8)
    "mistral4": dict(head_dim=16),
    # MoE blocks are off in the default config (dense Gemma); switch them on
    "gemma4": dict(text_config=dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K,
                                    moe_intermediate_size=32)),
    "diffusion_gemma": dict(text_config=dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K,
                                             moe_intermediate_size=32)),
    # sliding-window attention's head size must be the MLA query's (nope + rope = 8 + 8)
    "dots3_note": dict(text_config=dict(head_dim=16)),
    # the rotary sections default to a 128-wide head; the tiny head has 4 frequencies (h = w, then t);
    # text experts wider than the vision ones, as in the released models (1536 and 512)
    "ernie4_5_vl_moe": dict(text_config=dict(rope_parameters=dict(rope_theta=500000.0, rope_type="default",
                                                                  mrope_section=[1, 1, 2]),
                                             moe_intermediate_size=[48, 16])),
    # the default config has sparse-attention layers but leaves their indexer unset
    "qwen4_exp": dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16,
                                       indexer_compress_ratio=4)),
    # the default talker config lacks a field its shared expert reads
    "qwen3_omni_moe": dict(talker_config=dict(spatial_merge_size=2,
                                              text_config=dict(shared_expert_intermediate_size=32)),
                           # the released config.json names the vision start token, which the rotary index reads
                           thinker_config=dict(vision_start_token_id=3)),
}


@dataclass
class Family:
    """One decorated experts class's model family: the config class and the class that generates."""

    name: str  # transformers' models package, e.g. "qwen3_vl_moe"
    experts_classes: list[str]
    model_type: str | None = None
    config_class: type | None = None
    model_class: type | None = None
    problem: str = ""  # why it cannot be built (no generation class, ...)
    multimodal: bool = False


def _decorated(cls) -> bool:
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and "use_experts_implementation" in code.co_qualname


def experts_packages() -> Iterator[tuple[str, list[str]]]:
    """(models package, its decorated experts classes) for every package in the installed transformers."""
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        source = Path(models.__path__[0]) / info.name / f"modeling_{info.name}.py"
        if not source.is_file() or "use_experts_implementation" not in source.read_text(encoding="utf-8"):
            continue  # cheap pre-filter: importing every modeling module takes minutes
        module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        classes = [name for name, cls in vars(module).items()
                   if inspect.isclass(cls) and cls.__module__ == module.__name__ and _decorated(cls)]
        if classes:
            yield info.name, classes


def families() -> list[Family]:
    from transformers.models.auto import configuration_auto, modeling_auto

    types_by_package: dict[str, list[str]] = {}
    for model_type in configuration_auto.CONFIG_MAPPING_NAMES:
        types_by_package.setdefault(configuration_auto.model_type_to_module_name(model_type), []).append(model_type)
    # The image/audio-and-text classes first: for a model type that has one, the Hub's checkpoints
    # carry its composite config, which the text-only class cannot take.
    generators = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                  getattr(modeling_auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}),
                  modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    found = []
    for package, classes in experts_packages():
        family = Family(package, classes)
        found.append(family)
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        # The package's own model type first (the one its checkpoints on the Hub carry), then its others.
        types = sorted(types_by_package.get(package, []), key=lambda t: t != package)
        for model_type in types:
            name = next((m[model_type] for m in generators if model_type in m), None)
            if name is None:
                continue
            family.model_type = model_type
            family.config_class = configuration_auto.CONFIG_MAPPING[model_type]
            family.model_class = getattr(module, name, None) or getattr(importlib.import_module("transformers"), name)
            family.multimodal = model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or \
                "ForConditionalGeneration" in name
            break
        else:
            family.problem = "transformers has no class that generates text for it"
    return found


def _shrink_int(key: str, value: int) -> int:
    tiny = EXACT_RULES.get(key, VOCAB if "vocab_size" in key else None)
    if tiny is None:
        tiny = next((v for suffix, v in SUFFIX_RULES if key.endswith(suffix)), None)
    return tiny if tiny is not None and value > tiny else value


def _kept_layers(d: dict, layers: int) -> list[int]:
    """Which of `layers` layers the tiny model keeps: the first, then one of each other kind (the
    per-layer lists' values together: dense or sparse MLP, attention type, per-layer overrides)."""
    lists = [v for v in d.values() if isinstance(v, list) and len(v) == layers]
    per_layer = {int(k) for k in d.get("per_layer_config") or {} if str(k).isdigit()}

    def kind(i: int) -> tuple:
        return (*(str(v[i]) for v in lists), i in per_layer)

    kept, seen = [], set()
    for i in range(layers):
        if kind(i) not in seen and len(kept) < LAYERS:
            kept.append(i)
            seen.add(kind(i))
    kept += [i for i in range(layers) if i not in kept][: LAYERS - len(kept)]
    return sorted(kept)


def _shrink(d: dict) -> dict:
    """The config dict with every size shrunk, sub-configs included; per-layer lists keep a few
    layers of every kind."""
    layers = d.get("num_hidden_layers")
    kept = _kept_layers(d, layers) if isinstance(layers, int) and layers > LAYERS else None
    out = {}
    for key, value in d.items():
        if key == "per_layer_config" and isinstance(value, dict) and all(str(k).isdigit() for k in value):
            out[key] = {f"{kept.index(int(k)):02d}": _shrink(v) for k, v in value.items() if kept and int(k) in kept}
        elif isinstance(value, dict) and key not in ("rope_parameters", "rope_scaling"):
            out[key] = _shrink(value)
        elif isinstance(value, bool) or value is None or not isinstance(key, str):
            out[key] = value
        elif isinstance(value, int) and not key.endswith("_token_id"):
            out[key] = _shrink_int(key, value)
        elif isinstance(value, list) and kept and len(value) == layers:
            out[key] = [value[i] for i in kept]
        elif isinstance(value, list) and value and all(type(v) is int for v in value) and "size" in key:
            out[key] = [_shrink_int(key, v) for v in value]  # e.g. per-modality expert sizes
        else:
            out[key] = value
    rope = out.get("rope_parameters") or out.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(section := rope.get("mrope_section"), list):  # sums to head_dim / 2
        head = out.get("head_dim") or out.get("hidden_size", 32) // max(1, out.get("num_attention_heads", 1))
        half = head // 2
        rope["mrope_section"] = [half - (len(section) - 1) * (half // 4)] + [half // 4] * (len(section) - 1)
    for key in ("deepstack_visual_indexes", "fullatt_block_indexes"):
        if isinstance(out.get(key), list):  # indices of vision layers: keep those the tiny tower has
            out[key] = [i for i in out[key] if i < out.get("depth", 1)]
    if isinstance(out.get("qk_head_dim"), int) and isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out.get("qk_rope_head_dim", 0)  # MLA: derived, not free
    if "num_key_value_heads" in d and d.get("num_key_value_heads") == d.get("num_attention_heads"):
        out["num_key_value_heads"] = out.get("num_attention_heads")  # models that need as many as attention heads
    return out


def _apply(d: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            _apply(d[key], value)
        else:
            d[key] = value


def tiny_config(family: Family):
    """The family's config, shrunk; special token ids set inside the tiny vocabulary."""
    base = family.config_class().to_dict()
    small = _shrink(base)
    _apply(small, OVERRIDES.get(family.model_type, {}))
    for d in [small, *(v for v in small.values() if isinstance(v, dict))]:
        if "vocab_size" in d:
            d.update(eos_token_id=2, bos_token_id=1, pad_token_id=0)
    small.update(eos_token_id=2, bos_token_id=1, pad_token_id=0)
    small.pop("model_type", None)
    return family.config_class.from_dict(small)


@dataclass
class Built:
    path: Path
    experts_modules: int = 0
    notes: list[str] = field(default_factory=list)


def save_family_checkpoint(family: Family, path: Path, *, seed: int = 0) -> Built:
    """A tiny random checkpoint of `family` under `path`, with the test tokenizer."""
    from engine.model.layout import is_experts_module

    torch.manual_seed(seed)
    model = family.model_class(tiny_config(family)).to(torch.float32)
    # Random init gives near-uniform logits; widen them so greedy argmax is far from ties.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return Built(path, sum(1 for m in model.modules() if is_experts_module(m)))
