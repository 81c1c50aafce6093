"""User-facing errors: each says what is wrong and what to do about it."""

from __future__ import annotations


class MoEScopeError(Exception):
    """An error whose message is meant for the user, printed as one line."""

    kind = "error"


class CheckpointError(MoEScopeError):
    kind = "bad-checkpoint"


class NotMoEError(CheckpointError):
    kind = "not-moe"


class UnsafeCheckpointError(CheckpointError):
    kind = "unsafe-checkpoint"


class BudgetError(MoEScopeError):
    kind = "bad-budget"


class PromptTooLongError(MoEScopeError):
    kind = "prompt-too-long"


class DeviceError(MoEScopeError):
    kind = "device"
