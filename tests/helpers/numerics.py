"""Comparing bf16 results computed in another summation order."""

from __future__ import annotations

import torch


def close(ours: torch.Tensor, reference: torch.Tensor, what: str, relative: float = 0.02) -> None:
    """Within a few bf16 steps of the reference (by default 2 % of its largest value)."""
    scale = reference.float().abs().max().item()
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= relative * scale, f"{what}: max error {error} vs scale {scale}"
