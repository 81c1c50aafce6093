"""Whether and how a model runs on this machine: a verdict with the numbers behind it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.accounting.sizes import format_bytes
from engine.formats.blocks import FORMATS, parse_format
from engine.hub.estimate import CONTEXT_TOKENS, SizeEstimate, estimate_from_config, parallel_for
from engine.hub.machine import MachineInfo
from engine.hub.supported import SHORT_DTYPES

GiB = 1024**3
MiB = 1024**2
ACTIVATION_MARGIN = 256 * MiB  # prefill activations and decode scratch beyond the KV cache: headroom
GPU_RESERVE = 768 * MiB  # CUDA context, kernel workspaces, allocator slack
CPU_CACHE_SHARE = 0.8  # of the RAM left after dense weights: the rest stays free for the page cache and other apps
RAM_STORE_SHARE = 0.6  # the engine keeps experts in RAM (GPU runs) only below this share of free RAM (engine.decode.runtime)


@dataclass
class FitVerdict:
    kind: str  # fits-gpu | fits-ram | offload | too-big | unsupported
    headline: str  # one line with the numbers
    device: str | None = None  # cuda | cpu
    store: str | None = None  # ram | disk
    budget_bytes: int | None = None  # the recommended --budget
    budget_arg: str | None = None  # the same, written for --budget
    disk_short_bytes: int = 0  # more free disk the download needs
    details: list[str] = field(default_factory=list)
    parallel: int = 1  # replies that can decode at once beside the recommended budget (each its own KV cache)

    @property
    def runs(self) -> bool:
        return self.kind in ("fits-gpu", "fits-ram", "offload")


def assess(est: SizeEstimate, machine: MachineInfo, *, missing_bytes: int | None = None) -> FitVerdict:
    """Judge `est` against `machine`; `missing_bytes` is what is still to download (None: nothing/unknown)."""
    verdict = _run_verdict(est, machine)
    if missing_bytes and missing_bytes > machine.disk_free:
        verdict.disk_short_bytes = missing_bytes - machine.disk_free
        verdict.headline = (
            f"needs {format_bytes(verdict.disk_short_bytes)} more disk (download {format_bytes(missing_bytes)}, "
            f"{format_bytes(machine.disk_free)} free); then: {verdict.headline}"
        )
    return verdict


def _run_verdict(est: SizeEstimate, m: MachineInfo) -> FitVerdict:
    if est.problem:
        return FitVerdict("unsupported", f"cannot run yet: {est.problem}")
    kv, m = est.kv_bytes, with_model_footprint(est, m)
    how = "measured at this engine's last load" if m.overhead_measured else "estimated until a model loads"
    details = [f"working memory: KV cache for {CONTEXT_TOKENS} tokens {format_bytes(kv)}, activations "
               f"{format_bytes(ACTIVATION_MARGIN)}; engine overhead {format_bytes(m.engine_overhead)} ({how})"]
    if m.gpu_name and not m.cuda_usable:
        details.append(f"GPU {m.gpu_name} found, but this PyTorch build has no CUDA support: estimated for the CPU")
    if m.cuda_usable:
        gpu_fixed = est.dense_bytes + kv + GPU_RESERVE
        if gpu_fixed + est.all_expert_bytes <= m.vram_free:
            return FitVerdict(
                "fits-gpu",
                f"fits in GPU memory: {format_bytes(est.dense_bytes)} dense + {format_bytes(est.all_expert_bytes)} "
                f"experts of {format_bytes(m.vram_free)} free on {m.gpu_name}; use --budget all",
                "cuda", "ram", est.all_expert_bytes, "all", details=details,
            )
        if gpu_fixed + est.min_budget_bytes <= m.vram_free:
            budget = _whole_slots(min(est.all_expert_bytes, m.vram_free - gpu_fixed), est)
            store = "ram" if est.all_expert_bytes < RAM_STORE_SHARE * m.ram_available else "disk"
            return FitVerdict(
                "offload",
                f"runs on {m.gpu_name} with experts offloaded to {'RAM' if store == 'ram' else 'disk'}, budget "
                f"{format_bytes(budget)} recommended (minimum {format_bytes(est.min_budget_bytes)}, all experts "
                f"{format_bytes(est.all_expert_bytes)}; {format_bytes(m.vram_free)} GPU memory free)",
                "cuda", store, budget, budget_arg(budget, est), details=details,
            )
        details.append(
            f"dense weights + minimum budget ({format_bytes(gpu_fixed - GPU_RESERVE + est.min_budget_bytes)}) "
            f"exceed the free GPU memory ({format_bytes(m.vram_free)}): estimated for the CPU"
        )
    # Budgets are bytes for experts: the engine's own memory and the working memory come out of RAM first.
    cpu_fixed = est.dense_bytes + kv + ACTIVATION_MARGIN + m.engine_overhead
    if cpu_fixed + est.all_expert_bytes <= m.ram_available:
        return _with_parallel(est, m.ram_available - cpu_fixed - est.all_expert_bytes, FitVerdict(
            "fits-ram",
            f"fits in RAM: {format_bytes(cpu_fixed + est.all_expert_bytes)} with every expert resident and the "
            f"engine's own {format_bytes(m.engine_overhead)}, {format_bytes(m.ram_available)} available; use --budget all",
            "cpu", "disk", est.all_expert_bytes, "all", details=details,
        ))
    if cpu_fixed + est.min_budget_bytes <= m.ram_available:
        room = int((m.ram_available - cpu_fixed) * CPU_CACHE_SHARE)
        budget = _whole_slots(max(est.min_budget_bytes, min(est.all_expert_bytes, room)), est)
        return _with_parallel(est, m.ram_available - cpu_fixed - budget, FitVerdict(
            "offload",
            f"runs with experts offloaded to disk, budget {format_bytes(budget)} recommended (minimum "
            f"{format_bytes(est.min_budget_bytes)}, all experts {format_bytes(est.all_expert_bytes)}; "
            f"{format_bytes(m.ram_available)} RAM available)",
            "cpu", "disk", budget, budget_arg(budget, est), details=details,
        ))
    return FitVerdict(
        "too-big",
        f"too big for this machine: needs at least {format_bytes(cpu_fixed + est.min_budget_bytes)} of memory "
        f"(dense {format_bytes(est.dense_bytes)} + minimum budget {format_bytes(est.min_budget_bytes)} + working "
        f"memory {format_bytes(kv + ACTIVATION_MARGIN)} + engine overhead {format_bytes(m.engine_overhead)}), "
        f"{format_bytes(m.ram_available)} RAM available",
        details=details,
    )


def _with_parallel(est: SizeEstimate, spare_bytes: int, verdict: FitVerdict) -> FitVerdict:
    """The verdict with how many replies can decode at once (`moescope serve --parallel`): the first one's
    KV cache is counted already, each more takes another from the RAM left beside the budget."""
    verdict.parallel = parallel_for(0, est.kv_bytes_per_token, CONTEXT_TOKENS, spare_bytes + est.kv_bytes)
    verdict.details.append(f"replies at once: {verdict.parallel} fit beside this budget, each with its own KV cache "
                           f"for {CONTEXT_TOKENS} tokens ({format_bytes(est.kv_bytes)})")
    return verdict


def with_model_footprint(est: SizeEstimate, m: MachineInfo) -> MachineInfo:
    """`m` with the engine's own memory never below what it will use for this model (engine.hub.footprint:
    the runtime, bookkeeping per layer and expert, below `all` the miss path's staging), measured or not."""
    from dataclasses import replace

    from engine.hub.footprint import engine_own_bytes

    if not est.num_moe_layers:
        return m
    whole = est.dense_bytes + est.kv_bytes + ACTIVATION_MARGIN + est.all_expert_bytes
    own = engine_own_bytes(est, "all")
    if whole + max(own, m.engine_overhead) > m.ram_available:  # runs offloaded, if at all: the miss path's too
        own = engine_own_bytes(est, est.min_budget_bytes)
    return replace(m, engine_overhead=max(own, m.engine_overhead))


FORMAT_CHOICES = ("original", "q8_0", "q6_k", "q4_k", "q3_k", "q2_k")  # most precise first, as the window offers them
WHOLE = ("fits-gpu", "fits-ram")


@dataclass
class FormatVerdict:
    """The verdict with the routed experts stored in one format."""

    format: str  # original | q8_0 | ...
    estimate: SizeEstimate  # the sizes in that format
    verdict: FitVerdict

    @property
    def words(self) -> str:
        """"4-bit", or the checkpoint's dtype for the original."""
        if self.format == "original":
            return SHORT_DTYPES.get(self.estimate.dtype, self.estimate.dtype)
        return FORMATS[self.format].label.split(" ")[0]


def format_verdicts(est: SizeEstimate, machine: MachineInfo) -> list[FormatVerdict]:
    """The verdict in each format the window offers that the model's experts can be stored in."""
    if est.problem or not est.num_moe_layers:
        return []
    found = []
    for name in FORMAT_CHOICES:
        sized = est.in_format(parse_format(name))
        if sized is not None:
            found.append(FormatVerdict(name, sized, _run_verdict(sized, machine)))
    return found


def format_summary(verdicts: list[FormatVerdict]) -> str:
    """One line comparing formats when the format decides how the model runs, e.g. "fits in RAM at
    4-bit (12.3 GiB); offloaded at 25 % in bfloat16"; "" when the original weights fit whole already."""
    if not verdicts or verdicts[0].format != "original" or verdicts[0].verdict.kind in WHOLE:
        return ""
    original, parts = verdicts[0], []
    whole = next((v for v in verdicts[1:] if v.verdict.kind in WHOLE), None)
    if whole is not None:
        where = "GPU memory" if whole.verdict.kind == "fits-gpu" else "RAM"
        size = whole.estimate.dense_bytes + whole.estimate.all_expert_bytes
        parts.append(f"fits in {where} at {whole.words} ({format_bytes(size)})")
    if original.verdict.kind == "offload" and original.verdict.budget_bytes:
        share = original.verdict.budget_bytes / max(original.estimate.all_expert_bytes, 1)
        parts.append(f"offloaded at {share:.0%} in {original.words}")
    elif original.verdict.kind == "too-big":
        runs = next((v for v in verdicts[1:] if v.verdict.runs), None)
        if runs is not None and whole is None:
            share = (runs.verdict.budget_bytes or 0) / max(runs.estimate.all_expert_bytes, 1)
            parts.append(f"runs offloaded at {share:.0%} at {runs.words}")
        parts.append(f"too big in {original.words}")
    return "; ".join(parts)


def _whole_slots(nbytes: int, est: SizeEstimate) -> int:
    """Round down to whole expert slots (what the planner allocates), never below the minimum."""
    if est.bytes_per_expert <= 0:
        return nbytes
    return max(est.min_budget_bytes, nbytes // est.bytes_per_expert * est.bytes_per_expert)


def budget_arg(nbytes: int, est: SizeEstimate) -> str:
    """`nbytes` written for --budget, rounded down but never below the minimum budget."""
    if nbytes >= est.all_expert_bytes:
        return "all"
    gib = math.floor(nbytes / GiB * 10) / 10
    if gib >= 1 and gib * GiB >= est.min_budget_bytes:
        return f"{gib:g}GiB"
    return f"{max(math.floor(nbytes / MiB), math.ceil(est.min_budget_bytes / MiB))}MiB"


@dataclass
class QuantFit:
    """One quant file (or split set) of a GGUF repo with its own verdict."""

    label: str  # Q4_K_M ...
    files: list[str]
    size: int
    estimate: SizeEstimate
    verdict: FitVerdict
    local_path: Path | None  # its first file in the HF cache, when every part is there


@dataclass
class ModelFit:
    """Everything the CLI's `models info` and the window's library show about one model on this machine."""

    source: str  # the folder or Hub id asked about
    estimate: SizeEstimate
    verdict: FitVerdict
    machine: MachineInfo
    files: str  # where the weights are, or what is left to download, in one line
    missing_bytes: int = 0  # still to download
    local_path: Path | None = None  # a complete checkpoint folder, ready to load
    gated: bool = False
    remote: object | None = None  # engine.hub.remote's look-up, when the Hub was asked
    quants: list[QuantFit] = field(default_factory=list)  # a GGUF repo's choices, smallest first
    quant: str = ""  # the choice `estimate` and `verdict` describe (the recommended one)

    @property
    def formats(self) -> list[FormatVerdict]:
        return format_verdicts(self.estimate, self.machine)

    @property
    def notes(self) -> list[str]:
        gated = ["gated: accept its terms on the Hub and log in (`hf auth login`) before downloading"] if self.gated else []
        return list(self.verdict.details) + list(self.estimate.notes) + gated


def fit_model(ref: str, *, revision: str = "main", cache_dir: Path | None = None) -> ModelFit:
    """The fit verdict of a folder or a Hub id: from the files when they are here (a folder, or a
    complete copy in the HF cache: the Hub is not asked), else from the Hub's config.json, else,
    with no Hub, from a config.json an earlier look-up left in the cache."""
    from engine.hub.errors import HubError
    from engine.hub.estimate import estimate_folder
    from engine.hub.local import find_cached
    from engine.hub.machine import probe_machine
    from engine.hub.paths import hub_cache_dir

    cache_dir = cache_dir or hub_cache_dir()
    machine = probe_machine(cache_dir)
    folder = Path(ref).expanduser()
    if folder.is_file():  # a GGUF file (LM Studio's, Ollama's blob, a download): sized from its header
        from engine.hub.gguf_info import estimate_gguf, read_header

        header = read_header(folder)
        est = estimate_gguf(header)
        files = f"{format_bytes(header.file_bytes)} {header.quant} GGUF in {folder}"
        return ModelFit(str(folder), est, assess(est, machine), machine, files, local_path=folder)
    if folder.exists():
        est = estimate_folder(folder)
        files = f"{format_bytes(est.download_bytes or 0)} of weights in {folder}"
        return ModelFit(str(folder), est, assess(est, machine), machine, files, local_path=folder)
    cached = find_cached(ref, cache_dir)
    if cached is not None and cached.complete and not cached.gguf_files:  # a GGUF repo: the Hub lists its choices
        est = estimate_folder(cached.snapshot)
        files = f"downloaded: {format_bytes(cached.size_on_disk)} in the cache at {cached.snapshot}"
        return ModelFit(ref, est, assess(est, machine), machine, files, local_path=cached.snapshot)
    try:
        return remote_fit(ref, revision, machine, cache_dir)
    except HubError as exc:
        if cached is None or not cached.config:
            raise
        est = estimate_from_config(cached.config)  # the Hub is out of reach: the cached config still answers
        est.notes.append(f"from the config.json in the cache; the Hub did not answer ({exc})")
        missing = est.download_bytes or 0
        files = f"download about {format_bytes(missing)} (Hub not reachable)"
        return ModelFit(ref, est, assess(est, machine, missing_bytes=missing), machine, files, missing)


def remote_fit(repo_id: str, revision: str, machine: MachineInfo, cache_dir: Path) -> ModelFit:
    """The verdict from the Hub's look-up of `repo_id` (asked even when a copy is in the cache)."""
    from engine.hub.download import plan_download
    from engine.hub.remote import fetch_remote

    remote = fetch_remote(repo_id, revision=revision, cache_dir=cache_dir)
    if remote.gguf_files:
        return gguf_repo_fit(remote, machine, cache_dir)
    est = estimate_from_config(remote.config, weight_file_bytes=remote.weight_bytes)
    est.notes.extend(remote.notes)
    plan = plan_download(remote, cache_dir)
    verdict = assess(est, machine, missing_bytes=plan.missing_bytes)
    return ModelFit(repo_id, est, verdict, machine, _files_line(plan), plan.missing_bytes, gated=remote.gated,
                    remote=remote)


def gguf_repo_fit(remote, machine: MachineInfo, cache_dir: Path) -> ModelFit:
    """A GGUF repo: a verdict per quant file. One header is read (a downloaded choice's, else the smallest
    single file's first bytes from the Hub); the others are sized from it by file size."""
    from dataclasses import replace

    from engine.hub.download import plan_download
    from engine.hub.errors import HubError, translate
    from engine.hub.gguf_info import estimate_gguf, read_header, scaled_estimate
    from engine.hub.paths import hub_endpoint
    from engine.hub.remote_gguf import fetch_header, gguf_choices

    choices = gguf_choices(remote.gguf_files)
    if not choices:
        raise HubError(f"'{remote.repo_id}' holds no GGUF model files (only vision projectors); pick another repo")
    plans = [plan_download(replace(remote, files=c.files), cache_dir) for c in choices]
    local = {c.label: plan.snapshot / c.first for c, plan in zip(choices, plans, strict=True) if not plan.missing}
    base = next((c for c in choices if c.label in local), None) or next((c for c in choices if len(c.files) == 1),
                                                                        choices[0])
    if base.label in local:
        header = read_header(local[base.label])
    else:
        endpoint = hub_endpoint()
        try:
            header = fetch_header(remote.repo_id, remote.sha, base, endpoint=endpoint)
        except Exception as exc:
            raise translate(exc, remote.repo_id, endpoint=endpoint, what="look-up") from None
    base_est = estimate_gguf(header)
    base_est.download_bytes = base.size
    quants = []
    for choice, plan in zip(choices, plans, strict=True):
        if choice.label in local and choice is not base:
            est = estimate_gguf(read_header(local[choice.label]))
        elif choice is base:
            est = base_est
        else:
            est = scaled_estimate(base_est, choice.size, choice.label, base.label)
        verdict = assess(est, machine, missing_bytes=plan.missing_bytes)
        quants.append(QuantFit(choice.label, [f.name for f in choice.files], choice.size, est, verdict,
                               local.get(choice.label)))
    pick = recommended_quant(quants)
    files = (f"{pick.label}: downloaded in the cache at {pick.local_path}" if pick.local_path else
             f"{len(quants)} quant files; {pick.label}: download {format_bytes(pick.size)}")
    return ModelFit(remote.repo_id, pick.estimate, pick.verdict, machine, files,
                    0 if pick.local_path else pick.size, local_path=pick.local_path, gated=remote.gated,
                    remote=remote, quants=quants, quant=pick.label)


def recommended_quant(quants: list[QuantFit]) -> QuantFit:
    """The most precise (largest) choice that fits whole, else the largest that runs, else the smallest."""
    for kinds in (WHOLE, ("offload",)):
        runs = [q for q in quants if q.verdict.kind in kinds]
        if runs:
            return max(runs, key=lambda q: q.size)
    return quants[0]


def _files_line(plan) -> str:
    weights = sum(f.size or 0 for f in plan.present if f.name.endswith(".safetensors"))
    if not plan.missing:
        return f"downloaded: {format_bytes(sum(f.size or 0 for f in plan.present))} in the cache at {plan.snapshot}"
    more = f", {format_bytes(weights)} of weights already in the cache" if weights else ""
    count = len(plan.missing)
    return f"download {format_bytes(plan.missing_bytes)} ({count} file{'s' if count != 1 else ''}{more})"
