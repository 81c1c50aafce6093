"""Comparing bf16 results computed in another summation order."""

from __future__ import annotations

import torch


def close(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Within a couple of bf16 steps of the reference (relative to its largest value)."""
    scale = reference.float().abs().max().item()
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= 0.02 * scale, f"{what}: max error {error} vs scale {scale}"
