"""The one contract between the GUI process and the engine process.

Plain dataclasses: commands go in, events come out. This module imports neither torch nor Qt
(numpy only, for the compact matrices), so the GUI can import it and start fast. Matrices travel
as `Array` (the raw bytes of a numpy array plus dtype and shape), never as nested lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Array:
    """A numpy array as bytes: cheap to send, rebuilt without copying."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> Array:
        array = np.ascontiguousarray(array)
        return cls(array.dtype.str, tuple(array.shape), array.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


# ---------------------------------------------------------------- commands (GUI -> engine)


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class LoadModel:
    path: str  # a checkpoint folder, or "demo"
    budget: str = "all"  # 512MiB | 2GiB | 25% | all
    store: str = "auto"  # auto | disk | ram
    device: str = "auto"  # auto | cpu | cuda
    policy: str = "lru"
    dtype: str = "auto"
    allow_pickle: bool = False
    trust_remote_code: bool = False


@dataclass
class Generate:
    request_id: str
    messages: list[dict] | None = None  # chat turns: {"role": ..., "content": ...}
    prompt: str | None = None  # raw text (no chat template)
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Cancel:
    request_id: str | None = None  # None: whatever is running


@dataclass
class SetBudget:
    budget: str


@dataclass
class SetPolicy:
    policy: str


@dataclass
class SetTelemetry:
    enabled: bool = True
    interval_s: float = 0.1  # at most ~10 snapshots a second


@dataclass
class Unload:
    pass


@dataclass
class Shutdown:
    pass


Command = LoadModel | Generate | Cancel | SetBudget | SetPolicy | SetTelemetry | Unload | Shutdown


# ---------------------------------------------------------------- events (engine -> GUI)


@dataclass
class LoadProgress:
    fraction: float
    message: str


@dataclass
class PolicyInfo:
    name: str
    lossless: bool
    description: str


@dataclass
class ModelLoaded:
    name: str
    path: str
    architecture: str
    num_layers: int  # MoE layers
    num_experts: int  # per layer
    top_k: int
    expert_bytes: int  # one expert
    all_expert_bytes: int
    dense_bytes: int
    min_budget_bytes: int
    max_budget_bytes: int
    budget_bytes: int
    slots_per_layer: list[int]
    device: str
    store: str
    dtype: str
    context_length: int
    policy: str
    policies: list[PolicyInfo]
    load_seconds: float
    budget_note: str = ""  # e.g. the budget was clamped to the minimum


@dataclass
class Token:
    request_id: str
    text: str  # the new text since the previous Token event
    token_ids: list[int]


@dataclass
class Done:
    request_id: str
    finish_reason: str  # eos | length | stop | cancelled | error
    text: str
    token_ids: list[int]
    stats: dict  # engine.generation.GenerationStats as a dict


@dataclass
class BudgetChanged:
    requested: str
    budget_bytes: int
    slots_per_layer: list[int]
    note: str = ""


@dataclass
class PolicyChanged:
    policy: str
    lossless: bool


@dataclass
class TelemetrySnapshot:
    time: float  # seconds since the engine started
    state: str  # idle | loading | prefill | decoding
    request_id: str | None
    # speed of the current (or last) reply
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    ttft_s: float
    tokens_generated: int
    # cache behaviour
    hit_rate_recent: float  # over the last `recent_window` tokens
    hit_rate_total: float  # since load
    hit_rate_request: float
    recent_window: int
    layer_hit_rate: Array  # [layers] float32, since load
    layer_hit_rate_request: Array  # [layers] float32, this reply
    bytes_per_s_ondemand: float  # into the cache, since the previous snapshot
    bytes_per_s_prefetch: float
    stall_s_per_token: float
    bytes_loaded_total: int
    activation_request: Array  # [layers, experts] int32: tokens routed to each expert in this reply
    activation_total: Array  # [layers, experts] int64 since load
    resident: Array  # [layers, experts] bool
    slots_per_layer: list[int]
    budget_bytes: int
    policy: str
    link: str  # "disk -> RAM" | "PCIe host -> GPU" | "RAM -> RAM"
    # memory
    rss_bytes: int
    ram_used_bytes: int
    ram_total_bytes: int
    gpu_used_bytes: int | None = None
    gpu_total_bytes: int | None = None
    pcie_rx_bytes_per_s: float | None = None  # the driver's counter (nvidia-ml-py), host -> GPU
    pcie_tx_bytes_per_s: float | None = None
    # per-layer miss-ratio curves for the budget slider's live estimate: [layers, experts + 1] float32,
    # expected misses per token of each layer with s slots (see engine.planner); None until measured
    miss_curves: Array | None = None
    extra: dict = field(default_factory=dict)  # policy-specific figures (prefetch accuracy, ...)


@dataclass
class Error:
    kind: str  # bad-checkpoint | not-moe | unsafe-checkpoint | bad-budget | prompt-too-long | out-of-memory | engine-crashed | ...
    message: str  # one line, for the user
    recoverable: bool  # the engine is still usable (no restart needed)
    request_id: str | None = None


@dataclass
class Log:
    level: str  # debug | info | warning | error
    message: str


@dataclass
class EngineStarted:
    pid: int


Event = (
    LoadProgress | ModelLoaded | Token | Done | BudgetChanged | PolicyChanged | TelemetrySnapshot | Error | Log
    | EngineStarted
)
