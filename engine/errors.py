"""User-facing errors: each says what is wrong and what to do about it."""

from __future__ import annotations

# What --model (and the window's model) takes: the help and the missing-model error say the same
MODEL_ACCEPTS = ("a checkpoint folder, a .gguf file, a downloaded Hub id (org/name), a name `moescope models list` "
                 "shows (qwen3:30b, publisher/repo/file.gguf), or 'demo'")


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


class ContextFullError(PromptTooLongError):
    """A chat's history outgrew the context and its policy is to stop (not a message too long alone)."""


class DeviceError(MoEScopeError):
    kind = "device"
