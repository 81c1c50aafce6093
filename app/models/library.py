"""What the model library dialog shows, kept apart from the widgets (Qt-free, easy to test).

The dialog feeds every library event to `LibraryModel.apply` and redraws from the model: the
rows (catalog + HF cache, filtered by the search text as it is typed, then the Hub's results),
the fit estimate per model, the one download in flight, and a one-line status.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.models.format_choices import ORIGINAL, choice_label
from engine import protocol as p
from engine.accounting.sizes import format_bytes

RUNS = ("fits-gpu", "fits-ram", "offload")
KIND_WORDS = {"fits-gpu": "fits in GPU memory", "fits-ram": "fits in RAM", "offload": "runs offloaded",
              "too-big": "too big for this machine"}
FIT_WORDS = {**KIND_WORDS, "too-big": "too big", "unsupported": "cannot run yet"}  # the library's Fit column
SOURCE_WORDS = {"catalog": "catalog", "cache": "HF cache", "search": "Hub", "lmstudio": "LM Studio", "ollama": "Ollama"}


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_count(n: int | None) -> str:
    if not n:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def parse_request_id(request_id: str | None) -> tuple[str, str]:
    """"library:download:org/name" -> ("download", "org/name")."""
    _, action, repo = ((request_id or "") + "::").split(":", 2)
    return action, repo.rstrip(":")


@dataclass
class DownloadState:
    repo_id: str
    bytes_done: int = 0
    bytes_total: int = 0
    rate: float = 0.0
    eta_s: float | None = None
    message: str = "starting…"
    files_done: int = 0
    files_total: int = 0
    cancelling: bool = False

    @property
    def fraction(self) -> float | None:
        """None while the total is unknown (the look-up before the files)."""
        return min(1.0, self.bytes_done / self.bytes_total) if self.bytes_total > 0 else None

    @property
    def text(self) -> str:
        if self.cancelling:
            return f"Cancelling the download of {self.repo_id}…"
        if self.bytes_total <= 0:
            return self.message
        eta = f", {format_eta(self.eta_s)} left" if self.eta_s is not None else ""
        files = f" · file {min(self.files_done + 1, self.files_total)} of {self.files_total}" if self.files_total else ""
        return (f"{format_bytes(self.bytes_done)} of {format_bytes(self.bytes_total)} at "
                f"{format_bytes(self.rate)}/s{eta}{files}")


class LibraryModel:
    def __init__(self) -> None:
        self.local: list[p.LibraryEntry] = []  # catalog + HF cache
        self.hub: list[p.LibraryEntry] = []  # the last Hub search's results
        self.hub_query: str | None = None
        self.filter_text = ""
        self.estimates: dict[str, p.FitEstimateReady] = {}
        self.estimate_errors: dict[str, str] = {}
        self.estimating: set[str] = set()
        self.download: DownloadState | None = None
        self.listing = False  # a ListLibrary is on its way
        self.searching: str | None = None  # the search text on its way
        self.status = ""  # one line: the last failure or news
        self.status_is_error = False

    # ----- what to show -----
    def rows(self) -> list[p.LibraryEntry]:
        text = self.filter_text.strip().lower()
        local = [e for e in self.local if not text or text in e.repo_id.lower() or text in e.description.lower()
                 or text in e.title.lower()]
        known = {e.repo_id.lower() for e in self.local}
        return local + [e for e in self.hub if e.repo_id.lower() not in known]

    def entry(self, repo_id: str) -> p.LibraryEntry | None:
        key = repo_id.lower()
        return next((e for e in self.local + self.hub if e.repo_id.lower() == key), None)

    def estimate(self, repo_id: str) -> p.FitEstimateReady | None:
        return self.estimates.get(repo_id.lower())

    def status_text(self, entry: p.LibraryEntry) -> str:
        if self.download is not None and self.download.repo_id.lower() == entry.repo_id.lower():
            fraction = self.download.fraction
            return "downloading" + (f" {fraction:.0%}" if fraction is not None else "…")
        if entry.problem:
            return "downloaded, cannot run yet" if entry.downloaded else "cannot run yet"
        if entry.downloaded:
            return "downloaded"
        return "partly downloaded" if entry.partial else "not downloaded"

    @staticmethod
    def name_text(entry: p.LibraryEntry) -> str:
        return entry.title or entry.repo_id

    @staticmethod
    def source_text(entry: p.LibraryEntry) -> str:
        """Where the model is: a catalog entry already downloaded is in the HF cache."""
        if entry.source == "catalog" and entry.downloaded:
            return SOURCE_WORDS["cache"]
        return SOURCE_WORDS.get(entry.source, entry.source)

    def fit_kind(self, entry: p.LibraryEntry) -> str | None:
        """The verdict's kind: from the estimate once there is one, else from the listing (None: not known)."""
        est = self.estimate(entry.repo_id)
        return est.kind if est is not None else entry.fit_kind

    def fit_text(self, entry: p.LibraryEntry) -> str:
        kind = self.fit_kind(entry)
        return FIT_WORDS.get(kind, kind) if kind else ""

    def fit_headline(self, entry: p.LibraryEntry) -> str:
        est = self.estimate(entry.repo_id)
        return est.headline if est is not None else entry.fit_headline

    def size_text(self, entry: p.LibraryEntry) -> str:
        est = self.estimate(entry.repo_id)
        if est is not None:
            return format_bytes(est.total_bytes)
        if entry.size_bytes and entry.downloaded:
            return format_bytes(entry.size_bytes)
        return f"{format_count(entry.params)} params" if entry.params else ""

    def needs_estimate(self, repo_id: str) -> bool:
        key = repo_id.lower()
        return key not in self.estimates and key not in self.estimating and key not in self.estimate_errors

    def quant_fit(self, repo_id: str | None, quant: str = "") -> p.QuantFit | None:
        """A GGUF repo's quant file: the one named, else the recommended one; None for other models."""
        est = self.estimate(repo_id) if repo_id else None
        if est is None or not est.quants:
            return None
        label = (quant or est.quant).lower()
        return next((q for q in est.quants if q.label.lower() == label), est.quants[0])

    def can_download(self, repo_id: str | None, quant: str = "") -> bool:
        entry = self.entry(repo_id) if repo_id else None
        if entry is None or self.download is not None:
            return False
        if (picked := self.quant_fit(entry.repo_id, quant)) is not None:  # a GGUF repo: per quant file
            return picked.local_path is None
        if entry.downloaded:
            return False
        est = self.estimate(entry.repo_id)
        failed = entry.repo_id.lower() in self.estimate_errors  # e.g. no such repo: a download would fail the same way
        return not entry.problem and not failed and (est is None or est.kind != "unsupported")

    def use_target(self, repo_id: str | None, expert_format: str = ORIGINAL,
                   quant: str = "") -> tuple[str, str, str] | None:
        """(checkpoint folder or GGUF file, budget, expert format) for LoadModel, when the model is downloaded
        and runs here in that format (a GGUF repo: the quant file picked). The budget is the estimate's
        recommendation for the format; "" leaves it to the app's remembered budget."""
        entry = self.entry(repo_id) if repo_id else None
        if (picked := self.quant_fit(repo_id, quant)) is not None:
            return (picked.local_path, picked.budget, ORIGINAL) if picked.local_path and picked.budget else None
        if entry is None or not entry.downloaded or not entry.local_path or entry.problem:
            return None
        est = self.estimate(entry.repo_id)
        if est is None:
            return entry.local_path, "", expert_format
        verdict = next((f for f in est.formats if f.format == expert_format), None)
        budget = verdict.budget if verdict is not None else est.budget if expert_format == ORIGINAL else None
        if not budget:
            return None  # downloaded, but the verdict says it cannot run here (in this format)
        return entry.local_path, budget, expert_format

    # ----- events in -----
    def engine_started(self) -> None:
        """A new engine process: whatever the old one had under way is gone."""
        self.download, self.listing, self.searching = None, False, None
        self.estimating.clear()

    def apply(self, event) -> None:
        if isinstance(event, p.LibraryListing):
            self._listing(event)
        elif isinstance(event, p.FitEstimateReady):
            key = event.repo_id.lower()
            self.estimating.discard(key)
            self.estimate_errors.pop(key, None)
            self.estimates[key] = event
        elif isinstance(event, p.DownloadProgress):
            self._progress(event)
        elif isinstance(event, p.DownloadFinished):
            self._finished(event)
        elif isinstance(event, p.Error):
            self._error(event)

    def _listing(self, event: p.LibraryListing) -> None:
        if event.query is None:
            self.local, self.listing = list(event.entries), False
        else:
            self.hub, self.hub_query, self.searching = list(event.entries), event.query, None
            count = len(event.entries)
            self._say(f"{count} Hub result{'s' if count != 1 else ''} for “{event.query}”" if count
                      else f"no MoE models MoEScope can run match “{event.query}” on the Hub")

    def _progress(self, event: p.DownloadProgress) -> None:
        state = self.download
        if state is None or state.repo_id.lower() != event.repo_id.lower():
            state = self.download = DownloadState(event.repo_id)
        if event.cancelling:
            state.cancelling = True  # keep the bytes: the bar stays where it was
            return
        state.bytes_done, state.bytes_total, state.rate = event.bytes_done, event.bytes_total, event.rate_bytes_per_s
        state.eta_s, state.message = event.eta_s, event.message
        state.files_done, state.files_total = event.files_done, event.files_total

    def _finished(self, event: p.DownloadFinished) -> None:
        self.download = None
        for entry in self.local + self.hub:
            if entry.repo_id.lower() == event.repo_id.lower():
                entry.downloaded, entry.partial, entry.local_path = True, False, event.path
        if self.entry(event.repo_id) is None:
            self.local.append(p.LibraryEntry(event.repo_id, "in the Hugging Face cache", "cache", True, event.path))
        self._say(f"{event.repo_id} downloaded: select it and press Use to load it")

    def _error(self, event: p.Error) -> None:
        if event.kind == "engine-crashed":
            self.engine_started()
            self._say(f"the engine stopped: {event.message}", error=True)
            return
        if not p.is_library_event(event):
            return
        action, repo = parse_request_id(event.request_id)
        if action == "estimate":
            self.estimating.discard(repo.lower())
            self.estimate_errors[repo.lower()] = event.message
        elif action == "download" and event.kind != "download-busy":
            self.download = None
        elif action == "search":
            self.searching = None
        elif action == "list":
            self.listing = False
        self._say(event.message, error=event.kind != "cancelled")

    def _say(self, text: str, *, error: bool = False) -> None:
        self.status, self.status_is_error = text, error


def default_format(est: p.FitEstimateReady | None) -> str:
    """What "Use" loads unless the user picks another: the original weights, or, when they cannot run
    here, the most precise format that can."""
    if est is None or est.kind in RUNS or not est.formats:
        return ORIGINAL
    return next((f.format for f in est.formats if f.kind in RUNS), ORIGINAL)


def quant_choice_text(fit: p.QuantFit) -> str:
    """One quant file in the picker: "Q4_K_M · 17.28 GiB · runs offloaded (downloaded)"."""
    here = " (downloaded)" if fit.local_path else ""
    return f"{fit.label} · {format_bytes(fit.size_bytes)} · {FIT_WORDS.get(fit.kind, fit.kind)}{here}"


def format_lines(est: p.FitEstimateReady) -> list[str]:
    """One line per format: how the model runs here with its experts in it."""
    lines = []
    for fit in est.formats:
        how = KIND_WORDS.get(fit.kind, fit.kind)
        if fit.kind == "offload" and fit.budget_bytes:
            how += f" (budget {format_bytes(fit.budget_bytes)})"
        lines.append(f"{choice_label(fit.format)}: {how}; experts {format_bytes(fit.expert_bytes)}")
    return lines


def fit_lines(est: p.FitEstimateReady) -> list[tuple[str, str]]:
    """The numbers under the verdict, as (label, value) rows."""
    rows = [("Total size", f"{format_bytes(est.total_bytes)} ({format_count(est.total_params)} parameters, "
                           f"{format_count(est.active_params)} active per token, {est.dtype})")]
    if est.num_moe_layers:
        rows.append(("Experts", f"{format_bytes(est.expert_bytes)}: {est.num_experts} per layer x "
                                f"{est.num_moe_layers} MoE layers, top-{est.top_k}"))
    rows.append(("Dense weights", format_bytes(est.dense_bytes)))
    if est.num_moe_layers:
        rows.append(("Minimum budget", format_bytes(est.min_budget_bytes)))
    if est.budget:
        recommended = (f"all experts ({format_bytes(est.budget_bytes or 0)})" if est.budget == "all"
                       else est.budget.replace("GiB", " GiB").replace("MiB", " MiB"))  # what Use loads with
        rows.append(("Recommended budget", recommended))
    if est.formats:
        rows.append(("By format", "\n".join(format_lines(est))))
    rows.append(("Download", "downloaded" if est.downloaded else
                 format_bytes(est.download_bytes) if est.download_bytes else "nothing left to fetch"))
    return rows
