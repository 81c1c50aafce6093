"""The interface every cache policy implements."""

from __future__ import annotations

from collections.abc import Sequence


class CachePolicy:
    """Decides evictions (and, in subclasses, prefetches) for a per-layer expert cache.

    Hooks are called by `engine.cache_directory.CacheDirectory` in this order per layer and token:
    `on_access` (the router's choice is known), then `choose_victim` / `on_insert` / `on_evict`
    for each miss. `lossless` is False for policies that change the model's output.
    """

    name = "base"
    lossless = True
    description = ""

    def reset(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.step = 0

    def on_request_start(self) -> None:
        """A new request (reply) begins."""

    def on_token_end(self) -> None:
        self.step += 1

    def on_access(self, layer: int, experts: Sequence[int]) -> None:
        """`experts` (sorted, unique) are used by layer `layer` for the current token(s)."""

    def on_insert(self, layer: int, expert: int) -> None:
        """`expert` became resident in `layer`."""

    def on_evict(self, layer: int, expert: int) -> None:
        """`expert` left `layer`'s cache."""

    def choose_victim(self, layer: int, candidates: Sequence[int]) -> int:
        """Pick which of the resident `candidates` of `layer` to evict."""
        raise NotImplementedError
