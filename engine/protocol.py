"""The one contract between the GUI process and the engine process.

Plain dataclasses: commands go in, events come out. This module imports neither torch nor Qt
(numpy only, for the compact matrices), so the GUI can import it and start fast. Matrices travel
as `Array` (the raw bytes of a numpy array plus dtype and shape), never as nested lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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


@dataclass(frozen=True)
class SettingProblem:
    """One setting out of range: which field, and what is wrong, in words for the user."""

    field: str
    message: str


@dataclass
class SamplingSettings:
    """How to pick tokens: the one definition (the window, `moescope chat`, the server), validated by
    `problem()`. `moescope generate` asks for greedy explicitly (temperature 0)."""

    temperature: float = 0.7  # 0 = greedy
    top_p: float = 0.95
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def problem(self) -> SettingProblem | None:
        """The first setting out of range, or None when all are usable."""
        checks = (
            ("temperature", self.temperature >= 0, f"must be 0 (greedy) or more, got {self.temperature:g}"),
            ("top_p", 0 < self.top_p <= 1, f"must be above 0 and at most 1, got {self.top_p:g}"),
            ("top_k", self.top_k >= 0, f"must be 0 (off) or more, got {self.top_k}"),
            ("repetition_penalty", self.repetition_penalty > 0, f"must be above 0, got {self.repetition_penalty:g}"),
            ("max_new_tokens", self.max_new_tokens >= 1, f"must be at least 1, got {self.max_new_tokens}"),
        )
        for name, ok, message in checks:
            if not ok:  # NaN fails every comparison, so it is caught here too
                return SettingProblem(name, message)
        if any(not isinstance(s, str) for s in self.stop):
            return SettingProblem("stop", "must be a list of strings")
        return None


@dataclass
class LoadModel:
    """Load a model: the one definition of the load settings (the window, the CLI, the runtime)."""

    path: str  # a checkpoint folder, a downloaded Hub id (org/name), or "demo"
    budget: str = "all"  # 512MiB | 2GiB | 25% | all
    store: str = "auto"  # auto | disk | ram
    device: str = "auto"  # auto | cpu | cuda
    policy: str = "lru"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    allow_pickle: bool = False
    trust_remote_code: bool = False
    # decode on MoEScope's native CPU kernels where they run (bf16 on a CPU; elsewhere, or until they are
    # built, transformers' kernels, and telemetry says why). False (`--exact`): transformers' kernels only,
    # bit-identical to stock transformers; the native ones sum in another order.
    fast_decode: bool = True
    # opt-in, lossy: the native kernels' 4-bit (and other K-quant) matrices take their inputs rounded to
    # 8 bits (one scale per 256 values, as llama.cpp's Q8_K) and multiply them in integers, in prompts
    # and decode alike: llama.cpp's precision; the System panel's switch is live
    int8_inputs: bool = False
    expert_format: str = "original"  # routed experts: original | q8_0 | q6_k | q4_k | q3_k | q2_k (8bit, 4bit, ...)
    dense_format: str = "original"  # every other linear layer (not the routers): the same choices
    allocation: str = "planned"  # planned | uniform: how a budget is split across layers
    cpu_experts: str = "never"  # auto | never: Fiddler's CPU execution of misses (GPU + RAM store only)
    trace: str | None = None  # record routing to this file (JSON lines, engine.traces.trace)
    warm: bool = True  # at load: fill the cache, and run a first forward so torch's first-use setup is done
    pack_weights: bool = True  # CPU bf16/fp16: expert matrices pre-arranged for oneDNN at `all` (same bits)
    # replies that decode at once, in turns of one forward each, each with its own KV cache (the server's
    # clients, the window's chat beside them); 0: as many as memory holds, at most 4
    parallel: int = 0


# What a chat does when its history no longer fits the model's context (`Generate.context_overflow`):
# "drop-oldest" leaves the oldest whole turns out of the prompt (the system prompt and the new message stay;
# room is kept for the reply), "stop" refuses with a message saying so. The window and `moescope chat` default
# to "drop-oldest"; a request that does not say (the OpenAI server's) is "stop": an API client decides itself.
CONTEXT_OVERFLOW = ("drop-oldest", "stop")


@dataclass
class Generate:
    request_id: str
    messages: list[dict] | None = None  # chat turns: {"role": ..., "content": ...}
    prompt: str | None = None  # raw text (no chat template)
    prompt_ids: list[int] | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    return_routing: bool = False  # Done carries `routed_experts` (the OpenAI server's vLLM-shaped field)
    context_overflow: str = "stop"  # with messages: one of CONTEXT_OVERFLOW (a sender that predates it gets "stop")


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
class SetFastDecode:
    enabled: bool  # False: exact, transformers' kernels only (the System panel's "Exact" switch, live)


@dataclass
class SetInt8Inputs:
    enabled: bool  # the opt-in, lossy 8-bit inputs (LoadModel.int8_inputs), live


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


# ----- the model library (catalog, HF cache, Hub search, fit estimate, download)
# Failures come back as `Error(kind, one-line message, recoverable=True, request_id=...)` whose
# request_id starts with "library:" (`library_request_id`), so no chat reply mistakes them for its own.


def library_request_id(action: str, repo_id: str = "") -> str:
    """The request_id library failures carry: "library:<action>:<repo>"."""
    return f"library:{action}:{repo_id}"


@dataclass
class ListLibrary:
    """The catalog plus the runnable models already in the HF cache; answered by `LibraryListing`.
    Local only (no Hub look-ups), so it is quick and works offline."""

    @property
    def request_id(self) -> str:
        return library_request_id("list")


@dataclass
class SearchLibrary:
    """Hub text search for MoE models the engine runs; answered by `LibraryListing(query=text)`."""

    text: str
    limit: int = 30

    @property
    def request_id(self) -> str:
        return library_request_id("search")


@dataclass
class EstimateModel:
    """Sizes and whether the model fits this machine; answered by `FitEstimateReady`.
    Reads config.json only (from the cache when downloaded, else from the Hub)."""

    repo_id: str

    @property
    def request_id(self) -> str:
        return library_request_id("estimate", self.repo_id)


@dataclass
class DownloadModel:
    """Download into the HF cache in the background (chat goes on): `DownloadProgress` events,
    then `DownloadFinished` or an `Error` (kind "cancelled" after `CancelDownload`). One at a time."""

    repo_id: str
    quant: str = ""  # a GGUF repo: the quant file (set) to fetch, as FitEstimateReady.quants labels it

    @property
    def request_id(self) -> str:
        return library_request_id("download", self.repo_id)


@dataclass
class CancelDownload:
    repo_id: str | None = None  # None: whatever is downloading

    @property
    def request_id(self) -> str:
        return library_request_id("download", self.repo_id or "")


LIBRARY_COMMANDS = (ListLibrary, SearchLibrary, EstimateModel, DownloadModel, CancelDownload)

Command = (
    LoadModel | Generate | Cancel | SetBudget | SetPolicy | SetFastDecode | SetInt8Inputs | SetTelemetry | Unload | Shutdown
    | ListLibrary | SearchLibrary | EstimateModel | DownloadModel | CancelDownload
)


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


TEXT_ONLY_NOTE = "text only: this model also reads images, which MoEScope does not pass to it yet"


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
    fast_decode: bool = False  # the native decode kernels are on (asked for and available); else exact
    fast_decode_available: bool = False  # a CPU engine on a bf16 model: the switch changes something
    int8_inputs: bool = False  # the opt-in, lossy 8-bit inputs are on (LoadModel.int8_inputs)
    # the native kernels' variant in use ("x86-64-v3: AVX2 and FMA") or why none loaded, and why not a better one
    kernels: str = ""
    kernels_note: str = ""
    expert_format: str = "original"  # as loaded: original | q8_0 | q6_k | q4_k | ... (engine.formats.blocks)
    dense_format: str = "original"  # the other linear layers, the same choices
    remote: str = ""  # the server's URL when the engine is a remote OpenAI-compatible server (engine.remote)
    # the engine process's own memory, measured at the end of the load (engine.system.memory.EngineOverhead):
    overhead_bytes: int = 0  # resident beyond dense weights and experts: what a memory limit loses first
    baseline_rss_bytes: int = 0  # of it, before any weights (interpreter, torch, transformers); the rest is the model's code, tokenizer, kernels
    dense_resident_bytes: int = 0  # the dense weights in the engine's RAM as loaded (in their format; 0 on a GPU)
    # what the load decided that the user should know: tensors converted to another format, where the
    # popularity profile came from, experts computed on the CPU; the CLI prints the same lines
    load_notes: list[str] = field(default_factory=list)
    text_only: bool = False  # a multimodal model (images, audio) of which the text part runs; images are a later step
    parallel: int = 1  # replies that decode at once (LoadModel.parallel as resolved)


@dataclass
class Token:
    request_id: str
    text: str  # the new text since the previous Token event
    token_ids: list[int]


@dataclass
class PromptContext:
    """Sent before a reply's first token: the prompt the model sees, against its context. With
    `context_overflow="drop-oldest"` the oldest turns may be left out; `first_message` says where the
    model's memory starts (a client that predates it ignores it)."""

    request_id: str
    prompt_tokens: int  # the prompt as the model gets it (chat template applied, older turns dropped)
    context_length: int
    first_message: int = 0  # index in Generate.messages of the first message after the system prompt it sees
    dropped_messages: int = 0  # messages left out before it (0: the whole history fits)


@dataclass
class Draft:
    """A block-diffusion model's block as it reads after a denoising step: shown after the reply's
    text until the next Draft, or until the finished block arrives as Tokens."""

    request_id: str
    text: str


@dataclass
class ReplyStats:
    """What one reply cost: shown under it, kept in the chat history."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    hit_rate: float = 1.0
    decode_hit_rate: float = 1.0
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    decode_bytes_loaded: int = 0  # by the steps after the first token (the ones decode_tokens_per_s times)
    stall_s: float = 0.0
    budget_bytes: int = 0
    peak_rss_bytes: int = 0
    total_s: float = 0.0

    @classmethod
    def from_dict(cls, data: dict) -> ReplyStats:
        """From stored JSON: unknown keys (a newer version's) are dropped, missing ones take defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Done:
    request_id: str
    finish_reason: str  # eos | length | stop | cancelled | error
    text: str
    token_ids: list[int]
    stats: ReplyStats
    # with Generate.return_routing: [tokens, layers, top_k] int16, the experts each MoE layer ran for each
    # generated token fed back through the model (ids ascending per row, -1 pads), as vLLM's `routed_experts`
    routed_experts: Array | None = None


@dataclass
class FastDecodeChanged:
    enabled: bool
    available: bool
    int8_inputs: bool = False  # the lossy 8-bit inputs are on


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
class StreamInfo:
    """One reply decoding now, for the server dock's list of running requests."""

    request_id: str
    state: str  # prefill | decoding
    prompt_tokens: int
    tokens: int
    decode_tokens_per_s: float


@dataclass
class BatchSharing:
    """Expert uses of the replies that decode together, counted per turn (one forward of each reply):
    `uses` (layer, expert) picks in all, of which `distinct` differ. uses / distinct is how many times
    fewer experts a turn needs than the replies one at a time: below `all`, where their one-token
    steps run gathered (engine.decode.layer_gather), each is loaded once for all that picked it."""

    streams: int  # replies in the last turn
    turns: int  # turns with two replies or more, since the last reset (a batch starting from none)
    uses: int
    distinct: int
    layers: int

    @property
    def distinct_per_layer(self) -> float:
        return self.distinct / max(self.turns * self.layers, 1)

    @property
    def picks_per_expert(self) -> float:
        return self.uses / max(self.distinct, 1)

    def line(self) -> str:
        return (f"{self.streams} streams, {self.distinct_per_layer:.1f} distinct experts a layer, "
                f"each picked {self.picks_per_expert:.2f}x a turn")


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
    # expected misses per token of each layer with s slots (see engine.accounting.planner); None until measured
    miss_curves: Array | None = None
    decode_path: str = ""  # how the last decode token ran (exact kernels, native per layer, whole token...)
    decode_path_reason: str = ""  # why the next faster path did not run it ("" when the fastest did)
    extra: dict = field(default_factory=dict)  # policy-specific figures (prefetch accuracy, ...)
    streams: list[StreamInfo] = field(default_factory=list)  # the replies decoding now, oldest first
    sharing: BatchSharing | None = None  # while replies decode together: how much their experts overlap


@dataclass
class RoutingSnapshot:
    """Expert routing a remote server reported (engine.remote): what the heatmap shows when there is no
    cache of ours to count it. The other panels do not apply to a remote engine."""

    request_id: str | None
    activation_request: Array  # [layers, experts] int32: tokens routed to each expert in this reply
    activation_total: Array  # [layers, experts] int64 since connecting
    source: str  # where it came from, in words ("vLLM routed_experts", "SGLang expert distribution record")


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


# ----- the model library's answers


@dataclass
class LibraryEntry:
    repo_id: str  # Hub id, org/name; for a model another app downloaded, its file or folder (the key and the path)
    description: str = ""
    source: str = "catalog"  # catalog | cache | search | lmstudio | ollama
    downloaded: bool = False  # complete in the HF cache
    local_path: str | None = None  # the snapshot folder to load, when downloaded
    size_bytes: int | None = None  # on disk, when (partly) in the cache
    params: int | None = None  # parameter count, when the Hub says (search)
    model_type: str = ""
    downloads: int = 0  # Hub downloads (search)
    gated: bool = False
    partial: bool = False  # some files are in the cache, not all weights
    problem: str | None = None  # why MoEScope cannot run it, when known without the Hub
    title: str = ""  # the name to show when it is not repo_id (LM Studio's publisher/repo/file, Ollama's model:tag)
    quant: str = ""  # the weights' format when known: Q4_K_M, MXFP4, bf16 ...
    fit_kind: str | None = None  # the fit verdict when the listing already knows it (files another app has)
    fit_headline: str = ""


@dataclass
class LibraryListing:
    entries: list[LibraryEntry]
    query: str | None = None  # None: catalog + cache (ListLibrary); else the search text


@dataclass
class FormatFit:
    """The fit verdict with the routed experts stored in one format (engine.hub.fit.format_verdicts)."""

    format: str  # original | q8_0 | q6_k | q4_k | q3_k | q2_k
    kind: str  # fits-gpu | fits-ram | offload | too-big
    headline: str
    budget: str | None  # the recommended budget in this format, for LoadModel.budget; None: cannot run
    budget_bytes: int | None
    expert_bytes: int  # every expert, as slots in this format
    min_budget_bytes: int


@dataclass
class QuantFit:
    """One quant file (or split set) of a GGUF repo, with its own verdict (engine.hub.fit.gguf_repo_fit)."""

    label: str  # Q4_K_M, Q8_0 ...
    files: list[str]  # the part(s) a download fetches
    size_bytes: int
    kind: str  # fits-gpu | fits-ram | offload | too-big | unsupported
    headline: str
    budget: str | None  # the recommended budget with this file; None: cannot run
    local_path: str | None = None  # its first file, when downloaded: what LoadModel opens


@dataclass
class FitEstimateReady:
    """engine.hub.fit's verdict for this machine and the numbers behind it (bytes at the compute dtype)."""

    repo_id: str
    kind: str  # fits-gpu | fits-ram | offload | too-big | unsupported
    headline: str  # one line with the numbers
    budget: str | None  # the recommended budget, written for LoadModel.budget ("all", "3.5GiB"); None: cannot run
    budget_bytes: int | None
    total_bytes: int  # dense + every expert
    dense_bytes: int
    expert_bytes: int  # every expert, as slots
    min_budget_bytes: int
    num_experts: int  # per MoE layer
    num_moe_layers: int
    top_k: int
    total_params: int
    active_params: int
    dtype: str
    download_bytes: int  # still to download (0 when downloaded)
    downloaded: bool
    local_path: str | None = None
    gated: bool = False
    notes: list[str] = field(default_factory=list)
    formats: list[FormatFit] = field(default_factory=list)  # the verdict per weight format, most precise first
    format_summary: str = ""  # e.g. "fits in RAM at 4-bit (12.3 GiB); offloaded at 25% in bf16"; "" if moot
    quants: list[QuantFit] = field(default_factory=list)  # a GGUF repo's quant files, smallest first
    quant: str = ""  # the one the numbers above describe (the recommended one)


@dataclass
class DownloadProgress:
    repo_id: str
    bytes_done: int
    bytes_total: int  # what this download fetches (files already in the cache not counted)
    rate_bytes_per_s: float
    eta_s: float | None  # None: unknown yet
    message: str  # e.g. "model-00002-of-00003.safetensors: 1.2 GiB of 3.9 GiB at 40 MiB/s, 1:05 left"
    files_done: int = 0
    files_total: int = 0
    cancelling: bool = False  # CancelDownload arrived; the download stops at its next chunk


@dataclass
class DownloadFinished:
    repo_id: str
    path: str  # the snapshot folder, ready for LoadModel


LIBRARY_EVENTS = (LibraryListing, FitEstimateReady, DownloadProgress, DownloadFinished)


def is_library_event(event) -> bool:
    """The library's answers and failures: for the library dialog, not for the chat or the panels."""
    if isinstance(event, Error):
        return (event.request_id or "").startswith("library:")
    return isinstance(event, LIBRARY_EVENTS)


# ----- requests from the OpenAI-compatible server (engine.serve)

API_REQUEST_PREFIX = "api-"  # request ids of the server's requests, so the window's chat and banner leave them alone


def is_api_request(request_id: str | None) -> bool:
    return (request_id or "").startswith(API_REQUEST_PREFIX)


Event = (
    LoadProgress | ModelLoaded | PromptContext | Token | Draft | Done | BudgetChanged | PolicyChanged | FastDecodeChanged | TelemetrySnapshot
    | RoutingSnapshot | Error | Log | EngineStarted | LibraryListing | FitEstimateReady | DownloadProgress | DownloadFinished
)
