"""Hand-built protocol events and a scripted engine client for the GUI's widget-level tests.

(No tests here: helpers shared by tests/test_app_*.py.)
"""

from __future__ import annotations

import numpy as np

from engine import protocol as p


def model_loaded(layers: int = 4, experts: int = 8, top_k: int = 2, expert_bytes: int = 1024,
                 budget_slots: int | None = None, policies: list[p.PolicyInfo] | None = None) -> p.ModelLoaded:
    slots = budget_slots if budget_slots is not None else experts
    return p.ModelLoaded(
        name="tiny-test", path="/models/tiny-test", architecture="MixtralForCausalLM", num_layers=layers,
        num_experts=experts, top_k=top_k, expert_bytes=expert_bytes, all_expert_bytes=layers * experts * expert_bytes,
        dense_bytes=4096, min_budget_bytes=layers * top_k * expert_bytes,
        max_budget_bytes=layers * experts * expert_bytes, budget_bytes=layers * slots * expert_bytes,
        slots_per_layer=[slots] * layers, device="cpu", store="disk", dtype="float32", context_length=256,
        policy="lru",
        policies=policies or [p.PolicyInfo("lru", True, "least recently used"),
                              p.PolicyInfo("swapmoe", False, "virtual experts")],
        load_seconds=0.5,
    )


def miss_curves(layers: int, experts: int, top_k: int) -> np.ndarray:
    """Convex, decreasing per-layer curves: top_k misses per token with 0 slots, 0 with all."""
    s = np.arange(experts + 1, dtype=np.float32)
    base = top_k * (1 - s / experts) ** 2
    return np.stack([base * (1 + 0.1 * i) for i in range(layers)]).astype(np.float32)


def snapshot(t: float = 1.0, layers: int = 4, experts: int = 8, *, seed: int = 0, slots: int | None = None,
             counts: np.ndarray | None = None, resident: np.ndarray | None = None, curves: bool = True,
             gpu: bool = False, state: str = "decoding", expert_bytes: int = 1024) -> p.TelemetrySnapshot:
    rng = np.random.default_rng(seed)
    slots = experts if slots is None else slots
    if counts is None:
        counts = rng.integers(0, 20, size=(layers, experts)).astype(np.int32)
    if resident is None:
        resident = np.zeros((layers, experts), dtype=bool)
        resident[:, :slots] = True
    return p.TelemetrySnapshot(
        time=t, state=state, request_id="r1", decode_tokens_per_s=20.0, prefill_tokens_per_s=200.0, ttft_s=0.05,
        tokens_generated=10, hit_rate_recent=0.8, hit_rate_total=0.75, hit_rate_request=0.7, recent_window=64,
        layer_hit_rate=p.Array.of(rng.random(layers, dtype=np.float32)),
        layer_hit_rate_request=p.Array.of(rng.random(layers, dtype=np.float32)),
        bytes_per_s_ondemand=2e6, bytes_per_s_prefetch=1e6, stall_s_per_token=0.004, bytes_loaded_total=10**7,
        activation_request=p.Array.of(counts.astype(np.int32)),
        activation_total=p.Array.of(counts.astype(np.int64) * 3),
        resident=p.Array.of(resident), slots_per_layer=[slots] * layers, budget_bytes=layers * slots * expert_bytes,
        policy="lru", link="PCIe host -> GPU" if gpu else "disk -> RAM", rss_bytes=300 * 2**20,
        ram_used_bytes=4 * 2**30, ram_total_bytes=16 * 2**30,
        gpu_used_bytes=2 * 2**30 if gpu else None, gpu_total_bytes=8 * 2**30 if gpu else None,
        pcie_rx_bytes_per_s=3e6 if gpu else None, pcie_tx_bytes_per_s=1e5 if gpu else None,
        miss_curves=p.Array.of(miss_curves(layers, experts, 2)) if curves else None,
    )


class ScriptedClient:
    """Stands in for engine.process.client.EngineClient: records commands; tests push events through `emit`."""

    def __init__(self, on_event) -> None:
        self.on_event = on_event
        self.sent: list = []
        self.last_load: p.LoadModel | None = None
        self.alive = False
        self.starts = 0
        self.restarts = 0

    def start(self) -> None:
        self.alive = True
        self.starts += 1
        self.on_event(p.EngineStarted(4242))

    def send(self, command) -> None:
        if not self.alive:
            raise RuntimeError("the engine is not started")
        if isinstance(command, p.LoadModel):
            self.last_load = command
        if isinstance(command, p.SetBudget) and self.last_load is not None:
            self.last_load.budget = command.budget
        self.sent.append(command)

    def restart(self, reload: bool = True) -> None:
        self.restarts += 1
        self.start()
        if reload and self.last_load is not None:
            self.send(self.last_load)

    def stop(self) -> None:
        self.alive = False

    def emit(self, event) -> None:
        self.on_event(event)

    def of(self, kind: type) -> list:
        return [c for c in self.sent if isinstance(c, kind)]


class Recorder:
    """Every engine event a window saw, in order."""

    def __init__(self, window) -> None:
        self.events: list = []
        window.bridge.event.connect(self.events.append)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def done(self) -> list[p.Done]:
        return self.of(p.Done)
