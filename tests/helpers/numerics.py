"""Comparing bf16 results computed in another summation order."""

from __future__ import annotations

from collections.abc import Callable

import torch


def close(ours: torch.Tensor, reference: torch.Tensor, what: str, relative: float = 0.02) -> None:
    """Within a few bf16 steps of the reference (by default 2 % of its largest value)."""
    scale = reference.float().abs().max().item()
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= relative * scale, f"{what}: max error {error} vs scale {scale}"


def close_or_nearer_float32(ours: torch.Tensor, reference: torch.Tensor, float32: Callable[[], torch.Tensor],
                            what: str, relative: float) -> None:
    """`close` to the bf16 reference; or, where it is not, no further from the same weights in float32
    (`float32()`: those logits) than the reference is. Through a random model's layers the bf16
    roundings compound: where the CPU has no bf16 dot products, transformers' bf16 products round
    otherwise, and on some tiny models (Mixtral's, GLM-4.5's) its logits land 20-30 % from the float32
    ones while the native kernels, which sum in float32, stay within a few %."""
    scale = reference.float().abs().max().item()
    if (ours.float() - reference.float()).abs().max().item() <= relative * scale:
        return
    truth = float32().float()
    ours_off = (ours.float() - truth).abs().max().item()
    reference_off = (reference.float() - truth).abs().max().item()
    assert ours_off <= reference_off + 0.02 * scale, (
        f"{what}: {ours_off} from the float32 logits, the bf16 reference {reference_off} (scale {scale})")


def float32_prompt(runtime, prompt: list[int]) -> tuple[torch.Tensor, object]:
    """The last position's logits of `prompt` and its KV cache, from the runtime's model loaded again
    in float32 on transformers' kernels: the same weights (dequantized where stored in a block
    format), no bf16 rounding."""
    from dataclasses import replace

    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import SamplingSettings

    other = MoERuntime(replace(runtime.settings, dtype="float32", fast_decode=False))
    try:
        sequence = Generator(other).start(prompt, SamplingSettings(temperature=0, max_new_tokens=1))
        path, forward = sequence.prepare()
        with torch.inference_mode():
            return path.run(forward), forward.kv
    finally:
        other.close()


def same_top(ours: torch.Tensor, reference: torch.Tensor, what: str, ulps: int = 2) -> None:
    """The same most likely token as the reference, or one the reference scores within `ulps` bf16
    steps of its top (a near-tie, which another summation order may break either way)."""
    ours, reference = ours.float().flatten(), reference.float().flatten()
    top, mine = int(reference.argmax()), int(ours.argmax())
    ulp = 2.0 ** (torch.floor(torch.log2(reference[top].abs().clamp(min=1e-30))).item() - 7)
    assert (reference[top] - reference[mine]).item() <= ulps * ulp, f"{what}: top token {mine}, the reference's {top}"
