"""transformers' weight conversions, run on MoEScope's own loading path.

`from_pretrained` turns some checkpoint tensors into model weights with `WeightConverter`
operations (`transformers.core_model_loading`): q/k/v convolution kernels concatenated into one,
n-gram embedding shards joined, per-expert matrices stacked, gate/up rows de-interleaved. MoEScope
runs the same operations, in one place for every family:
- dense weights: the checkpoint tensors a converter gathers for one model weight are grouped at
  layout time (`DenseConversion`) and handed to transformers' own converter at load time;
- expert weights: read one expert at a time, so only converters that keep each expert's bytes
  separable are accepted (`expert_source`): stacking per-expert tensors, concatenating gate and
  up along the expert's rows, and de-interleaving rows, which the store undoes after each read;
  one list of experts split into several experts modules (ERNIE-4.5-VL's text and vision experts)
  is mapped expert by expert onto its module (`split_expert_list`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field

import torch
from transformers import core_model_loading
from transformers.core_model_loading import (
    Concatenate,
    Interleave,
    MergeModulelist,
    WeightConverter,
    dot_natural_key,
)

from engine.errors import CheckpointError
from engine.model.checkpoint import TensorRecord

ReadFn = Callable[[TensorRecord], torch.Tensor]


def describe(converter: WeightConverter) -> str:
    """The converter's operations as transformers names them, e.g. 'Interleave(dim=1), Chunk(dim=1)'."""
    return ", ".join(repr(op) for op in converter.operations)


@dataclass
class DenseConversion:
    """Dense model weights that one of transformers' converters makes from checkpoint tensors."""

    target: str  # the first model key it produces (transformers groups a converter's inputs under it)
    converter: WeightConverter  # the family's rule, never run itself: each load runs a copy
    sources: list[tuple[str, TensorRecord]] = field(default_factory=list)  # (source pattern, tensor)

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for _, record in self.sources)

    def run(self, model: torch.nn.Module, read: ReadFn) -> dict[str, torch.Tensor]:
        """The model weights, by full key, computed by transformers' converter from the source tensors
        (read in the order `from_pretrained` reads them, which sets the order of concatenated parts)."""
        converter = deepcopy(self.converter)
        ordered = sorted(self.sources, key=lambda source: dot_natural_key(source[1].name))
        for pattern, record in ordered:
            converter.add_tensor(self.target, record.name, pattern, lambda record=record: read(record))
        try:
            converted = converter.convert(self.target, model=model, config=model.config)
        except (ValueError, RuntimeError, TypeError, IndexError, KeyError, AttributeError) as exc:
            names = ", ".join(f"'{record.name}'" for _, record in ordered[:3])
            more = f" and {len(ordered) - 3} more" if len(ordered) > 3 else ""
            raise CheckpointError(
                f"cannot convert {names}{more} into '{self.target}' with transformers' {describe(self.converter)} "
                f"({str(exc).rstrip('.')}); check that the checkpoint is complete and matches its config.json"
            ) from None
        return {key: value[0] if isinstance(value, list) else value for key, value in converted.items()}


@dataclass(frozen=True)
class ExpertSource:
    """How one checkpoint tensor holds a part of an expert parameter."""

    fused: bool  # one [experts, ...] tensor for all experts, else one tensor per expert
    part: int = 0  # which of `parts` equal row blocks of the parameter it fills (gate=0, up=1)
    parts: int = 1
    interleave_dim: int | None = None  # the parameter's rows are interleaved in pairs along this dim on disk


class _Absent:
    """Stands for an operation this transformers release does not have: no operation is one."""


# Operations of a few families, looked up by name: older transformers releases lack them (and the families).
_SPLIT_TEXT_VISION = getattr(core_model_loading, "ErnieFuseAndSplitTextVisionExperts", _Absent)
# Dequantizes Inkling2Loop's NVFP4/MXFP8 experts; given the weight alone (no scales) it returns it as it is.
_DEQUANTIZE_ON_LOAD = getattr(core_model_loading, "Inkling2LoopDequantizeExperts", _Absent)


def _splits_expert_list(converter: WeightConverter | None) -> bool:
    """Whether the converter splits one checkpoint list of per-expert tensors into equal runs, one per
    target experts module, stacking each run and joining the sources along the rows (ERNIE-4.5-VL)."""
    ops = list(converter.operations) if converter is not None else []
    return (len(ops) == 1 and isinstance(ops[0], _SPLIT_TEXT_VISION)
            and ops[0].stack_dim == 0 and ops[0].concat_dim == 1)


def split_expert_list(converter: WeightConverter | None, model_key: str, key: str,
                      num_experts: int) -> tuple[str, int | None, WeightConverter | None]:
    """For a converter that splits a list of experts into several modules: the model key of the module
    checkpoint tensor `key` belongs to, its expert index there, and a converter that builds that
    module's weight from its own run alone (for a module kept in memory). Otherwise the arguments
    unchanged and no index. transformers names the first target module in `model_key` and splits the
    list into runs of equal length, which is the modules' common number of experts."""
    if not _splits_expert_list(converter):
        return model_key, None, converter
    match = re.search(r"\.experts\.(\d+)\.", key)
    targets = list(converter.target_patterns)
    if match is None or targets[0] not in model_key:
        raise CheckpointError(f"cannot tell which expert '{key}' is in transformers' {describe(converter)}")
    run, expert = divmod(int(match.group(1)), num_experts)
    if run >= len(targets):
        raise CheckpointError(f"tensor '{key}' is expert {run * num_experts + expert}, and transformers' "
                              f"{describe(converter)} splits {len(targets)} x {num_experts} experts")
    head, _, tail = model_key.rpartition(targets[0])
    sources = list(converter._original_source_patterns)
    ops = [MergeModulelist(dim=0)] + ([Concatenate(dim=1)] if len(sources) > 1 else [])
    return head + targets[run] + tail, expert, converter.copy(sources, [targets[run]], operations=ops)


def expert_source(converter: WeightConverter | None, pattern: str | None, key: str) -> ExpertSource:
    """Read an expert converter's operations as a slicing rule, or say which one cannot be sliced."""
    if converter is None:
        return ExpertSource(fused=True)  # the checkpoint already holds the model's [experts, ...] tensor
    sources = list(converter.source_patterns)
    ops = list(converter.operations)
    if ops and isinstance(ops[0], _DEQUANTIZE_ON_LOAD):
        if pattern != sources[0]:
            raise CheckpointError(
                f"expert weight '{key}' is a scale of experts quantized in a format that transformers dequantizes "
                f"on load ({describe(converter)}); MoEScope cannot read such experts yet: use a checkpoint whose "
                "experts are stored unquantized or in bf16")
        ops, sources = ops[1:], sources[:1]  # the weight alone: the operation passes it through
    fused = not (ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0)
    if not fused:
        ops = ops[1:]
    part, parts, interleave_dim = 0, 1, None
    for i, op in enumerate(ops):
        if isinstance(op, Concatenate) and op.dim == 1 and interleave_dim is None:
            part, parts = sources.index(pattern), len(sources)
        elif isinstance(op, Interleave) and op.dim >= 1 and not op.inverse and i == len(ops) - 1:
            interleave_dim = op.dim - 1  # in one expert's tensor, which has no experts dimension
        else:
            raise CheckpointError(
                f"expert weight '{key}' needs transformers' {describe(converter)}, and MoEScope cannot read one "
                f"expert at a time through {op!r}; it slices experts stacked with MergeModulelist(dim=0), joined "
                "with Concatenate(dim=1) or interleaved with Interleave(dim>=1)"
            )
    if len(sources) != parts:
        raise CheckpointError(
            f"expert weight '{key}' is one of {len(sources)} tensors that transformers' {describe(converter)} "
            "combines, and MoEScope can only join such tensors with Concatenate(dim=1)"
        )
    return ExpertSource(fused, part, parts, interleave_dim)


def undo_interleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """One expert's parameter as the model reads it, from rows interleaved in pairs along `dim`
    (gate 0, up 0, gate 1, ...): transformers' own `Interleave` operation."""
    return Interleave(dim=dim).convert({"w": tensor}, source_patterns=["w"], target_patterns=["w"])["w"]


def weave_halves(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The reverse of `undo_interleave`: two halves along `dim` (gate rows, up rows) as pairs (gate 0,
    up 0, gate 1, ...), transformers' inverse `Interleave`."""
    return Interleave(dim=dim, inverse=True).convert({"w": tensor}, source_patterns=["w"], target_patterns=["w"])["w"]
