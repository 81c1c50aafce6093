"""Which transformers class generates text for a checkpoint's config.

The auto mapping for causal LMs covers most families, but not all: some ship their causal-LM
class outside it (Mistral-4), and multimodal MoE families (Qwen3-VL-MoE, GLM-4.5V, ...) generate
text only through their conditional-generation class. The config's `architectures` names the
class the checkpoint was saved from; where it is a transformers class that generates, it is
the one. Multimodal classes run text-only chat here (images are a later step). Block-diffusion
classes (DiffusionGemma) write text through their own `generate`, blocks of tokens denoised
together; `is_block_diffusion` tells the generation loop to hand the reply to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers.models.auto import modeling_auto

from engine.errors import CheckpointError


@dataclass(frozen=True)
class ModelClass:
    cls: type
    text_only: bool  # a multimodal model of which MoEScope runs the text part only


def _multimodal(cls: type) -> bool:
    return "ForConditionalGeneration" in cls.__name__


def is_block_diffusion(cls: type | None) -> bool:
    """A class that writes blocks of tokens by denoising them together, through a `generate` of its own
    (transformers names them `...ForBlockDiffusion`; they are not `GenerationMixin`s)."""
    return isinstance(cls, type) and cls.__name__.endswith("ForBlockDiffusion") and callable(getattr(cls, "generate", None))


def _generates(cls: type | None, config, *, own_config: bool = True) -> bool:
    from transformers import GenerationMixin

    config_class = getattr(cls, "config_class", None)
    return (isinstance(cls, type) and (issubclass(cls, GenerationMixin) or is_block_diffusion(cls))
            and (not own_config or config_class is None or isinstance(config, config_class)))


def _text_only(cls: type, config) -> bool:
    """A class that also takes images (MoEScope runs its text part): a conditional-generation class, or a
    block-diffusion one with a vision tower."""
    return _multimodal(cls) or (is_block_diffusion(cls) and getattr(config, "vision_config", None) is not None)


def model_class(config) -> ModelClass:
    """The class that generates text for `config`: the one its `architectures` names if transformers
    has it, else the auto mapping for causal LMs, then the image-and-text ones."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if _generates(cls, config):
            return ModelClass(cls, _text_only(cls, config))
    mappings = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
                getattr(modeling_auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING", {}))
    for mapping in mappings:
        try:
            cls = mapping[type(config)]
        except (KeyError, ValueError):
            continue
        # the auto mapping may give a family another's class (Sarvam-MoE runs as GLM-4-MoE)
        if _generates(cls, config, own_config=False):
            return ModelClass(cls, _text_only(cls, config))
    named = ", ".join(getattr(config, "architectures", None) or []) or "none"
    raise CheckpointError(
        f"transformers {transformers.__version__} has no class that generates text for model type "
        f"'{config.model_type}' (config.json's architectures: {named}); a newer transformers may have one"
    )


def text_generator(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """The module that writes text and its path in `model`: `model` itself (path ''), or, where the
    class has no forward of its own, its child that generates (what the class's own generate calls
    for text only). Speech and other outputs are not run, nor their weights loaded."""
    if type(model).forward is not torch.nn.Module.forward:
        return "", model
    for name, child in model.named_children():
        if _generates(type(child), child.config) and type(child).forward is not torch.nn.Module.forward:
            return name, child
    raise CheckpointError(f"{type(model).__name__} has no forward and no submodule that generates text; "
                          "MoEScope cannot chat with it")
