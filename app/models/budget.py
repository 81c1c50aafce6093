"""The budget slider's arithmetic (Qt-free): positions <-> bytes, and the memory that is free."""

from __future__ import annotations

from dataclasses import dataclass

from engine import protocol as p

MAX_STEPS = 1000  # enough resolution for a smooth drag; a model with fewer slots gets one step per slot


@dataclass(frozen=True)
class BudgetScale:
    min_bytes: int
    max_bytes: int
    slot_bytes: int  # one expert: the natural step

    @property
    def steps(self) -> int:
        span = max(self.max_bytes - self.min_bytes, 0)
        slots = span // max(self.slot_bytes, 1)
        return max(1, min(MAX_STEPS, int(slots)))

    def to_bytes(self, position: int) -> int:
        position = min(max(position, 0), self.steps)
        return self.min_bytes + round((self.max_bytes - self.min_bytes) * position / self.steps)

    def to_position(self, nbytes: int) -> int:
        span = self.max_bytes - self.min_bytes
        if span <= 0:
            return self.steps
        return min(self.steps, max(0, round((nbytes - self.min_bytes) * self.steps / span)))

    def budget_text(self, position: int) -> str:
        """What SetBudget carries: 'all' at the top (no rounding), else exact bytes."""
        return "all" if position >= self.steps else str(self.to_bytes(position))

    def fraction(self, nbytes: int) -> float:
        return nbytes / self.max_bytes if self.max_bytes else 1.0


def same_share(budget: str, budget_bytes: int | None, all_expert_bytes: int) -> str:
    """The budget for reloading in another weight format: the same share of the experts' bytes.

    A byte budget (the slider's) in force becomes the percentage of the experts it is now, so 50 % of
    the bf16 experts becomes 50 % of the 4-bit ones rather than all of them; "all" and percentages
    already are shares. The engine clamps the result to the new format's minimum, with a note."""
    text = budget.strip().lower()
    if text in ("all", "everything", "max") or text.endswith("%") or not budget_bytes or all_expert_bytes <= 0:
        return budget
    share = budget_bytes / all_expert_bytes
    if share >= 1.0:
        return "all"
    return f"{max(share * 100, 0.01):.2f}%"


def free_for_budget(budget_bytes: int, available_bytes: int) -> int:
    """The largest budget that fits now: what is free plus what the cache already holds."""
    return budget_bytes + max(available_bytes, 0)


def free_compute_memory(snapshot, budget_bytes: int) -> tuple[str, int] | None:
    """(where, bytes): VRAM from the engine's snapshot with a GPU, else RAM as this process sees it."""
    if snapshot is not None and snapshot.gpu_total_bytes and snapshot.gpu_used_bytes is not None:
        return "free VRAM", free_for_budget(budget_bytes, snapshot.gpu_total_bytes - snapshot.gpu_used_bytes)
    try:
        import psutil

        return "free RAM", free_for_budget(budget_bytes, psutil.virtual_memory().available)
    except Exception:  # psutil missing or unreadable: no marker is better than a wrong one
        return None


def memory_breakdown(model: p.ModelLoaded | None, snapshot: p.TelemetrySnapshot | None) -> list[tuple[str, int]]:
    """The engine process's resident memory in parts, from the load's measurement and the latest
    snapshot: [] for an engine that did not measure itself (a remote server, an older engine)."""
    if model is None or snapshot is None or not model.overhead_bytes:
        return []
    parts = [("engine overhead", model.overhead_bytes)]
    if model.dense_resident_bytes:
        parts.append(("dense weights", model.dense_resident_bytes))
    if model.device == "cpu":  # with a GPU, the cache's slots are in GPU memory
        parts.append(("expert cache", snapshot.budget_bytes))
    parts.append(("KV cache and scratch", max(snapshot.rss_bytes - sum(n for _, n in parts), 0)))
    return parts
