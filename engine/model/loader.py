"""Opening a checkpoint for offloaded inference.

The model is built with its parameters on the meta device (no memory), dense weights are read
from the safetensors files onto the compute device, and the routed experts' parameters are
dropped from the model: their bytes stay in the store and come in through the expert cache.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import CheckpointError, DeviceError
from engine.model import experts_registry as experts_impl
from engine.model.checkpoint import CheckpointFiles, TensorRecord, open_checkpoint
from engine.model.dtypes import resolve_dtype
from engine.model.gguf.file import is_gguf
from engine.model.layout import MoELayout, build_layout
from engine.model.loaded import LoadedWeights, ProgressFn, set_tensor, tie_loaded
from engine.model.model_class import ModelClass, model_class, text_generator
from engine.model.prequantized import dequantize_tensor


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu")
    if name not in ("cpu", "cuda"):
        raise DeviceError(f"unknown device '{name}'; use cpu, cuda or auto")
    return torch.device(name)


def build_model(
    path: Path,
    *,
    device: torch.device,
    dtype: str = "auto",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    progress: ProgressFn | None = None,
    load_dense: bool = True,
) -> LoadedWeights:
    if is_gguf(Path(path)):
        from engine.model.gguf.loader import build_gguf_model

        return build_gguf_model(Path(path), device=device, dtype=dtype, progress=progress, load_dense=load_dense)
    files = open_checkpoint(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    compute_dtype = resolve_dtype(dtype, files.config)
    experts_impl.register()
    config = _read_config(files, trust_remote_code)
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    chosen = None if remote else model_class(config)
    prefix, model = text_generator(_empty_model(files, config, chosen, compute_dtype))
    files = files.under(prefix)
    _read_generation_config(model, files)
    layout = build_layout(model, files, compute_dtype)
    _drop_expert_params(model, layout)
    text_only = chosen is not None and chosen.text_only
    if load_dense:
        _load_dense(model, layout, device, progress)
        model.to(device)  # non-persistent buffers (rotary tables) are created on the CPU
        model.eval().requires_grad_(False)
    return LoadedWeights(model, layout, files, compute_dtype, text_only=text_only)


def _read_config(files: CheckpointFiles, trust_remote_code: bool):
    """The checkpoint's config as transformers reads it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(files.root, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"transformers cannot read {files.root / 'config.json'}: {exc}") from None


def _empty_model(files: CheckpointFiles, config, chosen: ModelClass | None,
                 compute_dtype: torch.dtype) -> torch.nn.Module:
    """The model with its parameters on the meta device: `chosen`'s class, or (None) the checkpoint's
    own code through the auto class."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), init_empty_weights(include_buffers=False):
        warnings.simplefilter("ignore")
        try:
            kwargs = dict(dtype=compute_dtype, experts_implementation=experts_impl.IMPLEMENTATION_NAME)
            if chosen is None:
                return AutoModelForCausalLM.from_config(config, trust_remote_code=True, **kwargs)
            return chosen.cls._from_config(config, **kwargs)
        except ValueError as exc:
            raise CheckpointError(f"transformers cannot build '{files.root.name}' as a causal LM: {exc}") from None
        except ModuleNotFoundError as exc:  # a family's model code may import what transformers does not require
            package = (exc.name or "?").split(".")[0]
            raise CheckpointError(f"transformers' code for '{files.root.name}' ({type(config).__name__}) needs the "
                                  f"Python package '{package}', which is not installed; install it "
                                  f"(pip install {package}) and load again") from None


def _read_generation_config(model: torch.nn.Module, files: CheckpointFiles) -> None:
    """The checkpoint's generation_config.json onto the model, where it has one."""
    if not (files.root / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    # from_pretrained reads this file too: its EOS ids and defaults are the model author's. In the
    # class's own kind where it has one (a block-diffusion model's holds its denoising schedule).
    config_class = getattr(type(model), "generation_config_class", None) or GenerationConfig
    model.generation_config = config_class.from_pretrained(files.root)


def _drop_expert_params(model: torch.nn.Module, layout: MoELayout) -> None:
    """The offloaded experts' parameters off the model: their bytes live in the store."""
    for module_path, _ in layout.experts_modules():
        experts = model.get_submodule(module_path)
        for p in layout.params:
            setattr(experts, p.name, None)  # slots are the only copy


def _load_dense(model: torch.nn.Module, layout: MoELayout, device: torch.device, progress: ProgressFn | None) -> None:
    total = max(1, layout.dense_bytes)
    done = 0
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())

    def place(key: str, tensor: torch.Tensor, source: str) -> None:
        if key not in state:
            return  # checkpoint extras the model does not use (e.g. unused MTP layers)
        target = state[key]
        if tensor.shape != target.shape:
            raise CheckpointError(f"'{key}' in {source} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        tensor = tensor.to(device=device, dtype=target.dtype)  # the runtime gathers them into huge pages
        set_tensor(model, key, tensor)

    unused: list[str] = []  # checkpoint tensors no model weight takes
    with _TensorReader() as read:
        for key, record in sorted(layout.dense.items(), key=lambda item: (item[1].file, item[1].offset)):
            if key in state:
                tensor = read(record)
                if key in layout.dense_scales:  # a quantized checkpoint's dense weight: dequantized here
                    tensor = dequantize_tensor(layout.checkpoint_quant, tensor, read(layout.dense_scales[key]),
                                               state[key].dtype)
                place(key, tensor, record.file.name)
            else:
                unused.append(record.name)  # checkpoint extras the model does not use (e.g. unused MTP layers)
            done += record.nbytes
            if progress:
                progress(done / total, f"dense weights from {record.file.name}")
        for conversion in layout.conversions.values():
            for key, tensor in conversion.run(model, read).items():
                place(key, tensor, conversion.sources[0][1].file.name)
            done += conversion.nbytes
            if progress:
                progress(done / total, f"dense weights converted into {conversion.target}")
    tie_loaded(model)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing and unused:
        raise CheckpointError(
            f"no checkpoint tensor maps to {len(missing)} model weights, e.g. '{missing[0]}', while {len(unused)} "
            f"checkpoint tensors map to none, e.g. '{unused[0]}': the checkpoint's names do not match what "
            "transformers' mapping for this model expects (a different transformers version may read it)")
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} weights, e.g. '{missing[0]}'; the download may be incomplete")


class _TensorReader:
    """Reads checkpoint tensors by record, each safetensors file opened once."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> Callable[[TensorRecord], torch.Tensor]:
        return self.read

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def read(self, record: TensorRecord) -> torch.Tensor:
        try:
            handle = self._handles.get(record.file)
            if handle is None:
                handle = self._stack.enter_context(safe_open(record.file, framework="pt", device="cpu"))
                self._handles[record.file] = handle
            return handle.get_tensor(record.name)
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read {record.file}: {exc}") from None
