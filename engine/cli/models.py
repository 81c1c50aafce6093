"""`moescope models list|search|info|download|remove`: the model library on the command line."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict
from itertools import chain
from pathlib import Path

from engine.errors import MoEScopeError


def add_models_parser(sub) -> None:
    models = sub.add_parser("models", help="find, size up, download and remove models (Hugging Face Hub)")
    verbs = models.add_subparsers(dest="models_command", required=True)
    ls = verbs.add_parser("list", help="the catalog and the models already downloaded, with what fits this machine")
    ls.add_argument("--all", action="store_true", help="also show cached repos MoEScope cannot run")
    ls.add_argument("--json", action="store_true")
    search = verbs.add_parser("search", help="search the Hub for MoE models MoEScope can run")
    search.add_argument("text")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true")
    info = verbs.add_parser("info", help="sizes and whether a model fits this machine, before downloading")
    info.add_argument("model", help="a Hub id (org/name) or a local checkpoint folder")
    info.add_argument("--revision", default="main")
    info.add_argument("--json", action="store_true")
    download = verbs.add_parser("download", help="download a model into the Hugging Face cache")
    download.add_argument("repo", help="a Hub id, e.g. Qwen/Qwen3-30B-A3B")
    download.add_argument("--revision", default="main")
    download.add_argument("--force", action="store_true", help="download even if MoEScope cannot run it yet")
    download.add_argument("--quant", help="a GGUF repo: the quant file to fetch, e.g. Q4_K_M (see `models info`)")
    remove = verbs.add_parser("remove", help="delete a downloaded model from the Hugging Face cache")
    remove.add_argument("repo")
    remove.add_argument("--yes", action="store_true", help="really delete (without it, only say what would go)")


def run_models(args: argparse.Namespace) -> int:
    return {"list": _list, "search": _search, "info": _info, "download": _download, "remove": _remove}[
        args.models_command](args)


# ----------------------------------------------------------------------------- list


def _list(args: argparse.Namespace) -> int:
    from engine.hub.catalog import load_catalog
    from engine.hub.local import list_cached_models
    from engine.hub.machine import probe_machine
    from engine.hub.paths import hub_cache_dir

    cache_dir = hub_cache_dir()
    machine = probe_machine(cache_dir)
    cached = {m.repo_id.lower(): m for m in list_cached_models(cache_dir, include_all=True)}
    if not args.json:
        print(_machine_line(machine, cache_dir))
    catalog = load_catalog()
    catalog_ids = {entry.repo_id.lower() for entry in catalog}
    rows = []
    # generators, so each row prints as soon as it is known: the Hub look-ups take a while
    for row in chain(_catalog_rows(catalog, cached, machine, cache_dir),
                     _cached_rows(cached, catalog_ids, machine, args.all),
                     _found_rows(cached, machine)):
        rows.append(row)
        if not args.json:
            _print_row(row)
    if args.json:
        print(json.dumps(rows))
    return 0


def _catalog_rows(catalog, cached: dict, machine, cache_dir: Path) -> Iterator[dict]:
    """The catalog's models: sized from the cache when downloaded, else from the Hub while it answers."""
    from huggingface_hub import constants

    from engine.hub.errors import NetworkError, OfflineError, RepoNotFoundError

    # why the Hub is not asked (None: it is); after one failed connection the other entries do not wait
    no_hub = "offline (HF_HUB_OFFLINE is set): sizes unknown" if constants.is_offline_mode() else None
    for entry in catalog:
        local = cached.get(entry.repo_id.lower())
        row = {"repo": entry.repo_id, "description": entry.description, "in_catalog": True}
        try:
            if local is not None and local.complete:
                row.update(_local_row(local, machine))
            elif no_hub is None:
                row.update(_remote_row(entry.repo_id, "main", machine, cache_dir))
            elif local is not None and local.config:  # an earlier look-up left config.json in the cache
                row.update(_config_row(local, machine, no_hub))
            else:
                row.update(status="not downloaded", verdict=no_hub)
        except RepoNotFoundError as exc:
            row.update(status="not on the Hub", verdict=str(exc))
        except (OfflineError, NetworkError) as exc:
            no_hub = "the Hub is not reachable: sizes unknown"
            row.update(status="not downloaded", verdict=str(exc))
        except MoEScopeError as exc:
            row.update(status="not downloaded", verdict=str(exc))
        yield row


def _cached_rows(cached: dict, catalog_ids: set[str], machine, show_all: bool) -> Iterator[dict]:
    """Hugging Face repos downloaded outside the catalog (GGUF repos come with the found models)."""
    for key, local in cached.items():
        if key in catalog_ids or local.gguf_files or not (local.runnable or show_all):
            continue
        row = {"repo": local.repo_id, "description": "", "in_catalog": False}
        try:
            row.update(_local_row(local, machine))
        except MoEScopeError as exc:
            row.update(status="downloaded", verdict=str(exc))
        yield row


def _found_rows(cached: dict, machine) -> Iterator[dict]:
    """GGUFs in the cache, LM Studio's, Ollama's: opened in place."""
    from engine.accounting.sizes import format_bytes
    from engine.hub.fit import assess
    from engine.hub.found import SOURCES
    from engine.process.library_service import found_models

    for model in found_models(list(cached.values())):
        row = {"repo": model.name, "description": f"{SOURCES[model.source]}, {model.quant or 'unknown format'}",
               "in_catalog": False, "source": model.source, "path": str(model.path),
               "status": f"downloaded, {format_bytes(model.size_bytes)}"}
        if model.estimate is None:
            row["verdict"] = f"cannot run yet: {model.problem}"
        else:
            verdict = assess(model.estimate, machine)
            row.update(verdict=verdict.headline, budget=verdict.budget_arg)
        yield row


def _local_row(local, machine) -> dict:
    from engine.accounting.sizes import format_bytes
    from engine.hub.estimate import estimate_folder
    from engine.hub.fit import assess

    status = f"downloaded, {format_bytes(local.size_on_disk)}" if local.complete else "partly downloaded"
    if local.problem and local.complete:
        return {"status": status, "path": str(local.snapshot), "verdict": f"cannot run yet: {local.problem}"}
    verdict = assess(estimate_folder(local.snapshot), machine)
    return {"status": status, "path": str(local.snapshot), "verdict": verdict.headline, "budget": verdict.budget_arg}


def _config_row(local, machine, why: str) -> dict:
    from engine.accounting.sizes import format_bytes
    from engine.hub.estimate import estimate_from_config
    from engine.hub.fit import assess

    est = estimate_from_config(local.config)
    size = f", about {format_bytes(est.download_bytes)}" if est.download_bytes else ""
    verdict = assess(est, machine, missing_bytes=est.download_bytes)
    return {"status": f"not downloaded{size}; {why.split(':')[0]}", "verdict": verdict.headline,
            "budget": verdict.budget_arg}


def _remote_row(repo_id: str, revision: str, machine, cache_dir: Path) -> dict:
    from engine.accounting.sizes import format_bytes
    from engine.hub.download import plan_download
    from engine.hub.fit import remote_fit

    fit = remote_fit(repo_id, revision, machine, cache_dir)
    remote, verdict = fit.remote, fit.verdict
    plan = plan_download(remote, cache_dir)
    has_weights = any(f.name.endswith(".safetensors") for f in plan.present)
    status = "partly downloaded" if has_weights and plan.missing else "downloaded" if has_weights else "not downloaded"
    size = f", download {format_bytes(plan.missing_bytes)}" if plan.missing_bytes else ""
    gated = " (gated: accept its terms on the Hub)" if remote.gated else ""
    return {"status": status + size + gated, "verdict": verdict.headline, "budget": verdict.budget_arg}


def _print_row(row: dict) -> None:
    head = f"{row['repo']}  [{row.get('status', '')}]"
    print(head + (f"  {row['description']}" if row.get("description") else ""))
    print(f"    {row.get('verdict', '')}")


# ----------------------------------------------------------------------------- search


def quantization_flag(quantization: str | None) -> str:
    from engine.hub.supported import RUNNABLE_QUANTIZATIONS

    if not quantization:
        return ""
    return f", {quantization}" + ("" if quantization in RUNNABLE_QUANTIZATIONS else " (not runnable)")


def _search(args: argparse.Namespace) -> int:
    from engine.hub.remote import search_models

    hits = search_models(args.text, limit=args.limit)
    if args.json:
        print(json.dumps([asdict(h) for h in hits]))
        return 0
    if not hits:
        print(f"no MoE models MoEScope can run match '{args.text}' on the Hub")
        return 0
    for h in hits:
        params = f"{h.params / 1e9:.1f}B params" if h.params else "size unknown"
        quant = ", GGUF: pick a quant file (models info)" if h.gguf else quantization_flag(h.quantization)
        flags = "".join([", gated" if h.gated else "", quant])
        print(f"{h.repo_id:55s} {h.model_type:14s} {params:>16s}  {h.downloads:>9d} downloads{flags}")
    print("sizes and fit for this machine: moescope models info ORG/NAME", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- info


def _info(args: argparse.Namespace) -> int:
    from engine.accounting.sizes import format_bytes
    from engine.hub.fit import fit_model, format_summary
    from engine.hub.paths import hub_cache_dir

    cache_dir = hub_cache_dir()
    fit = fit_model(args.model, revision=args.revision, cache_dir=cache_dir)
    est = fit.estimate
    if args.json:
        print(json.dumps({"model": fit.source, "estimate": asdict(est), "verdict": asdict(fit.verdict),
                          "machine": asdict(fit.machine), "gated": fit.gated, "missing_bytes": fit.missing_bytes}))
        return 0
    quant = f", {fit.quant} of {len(fit.quants)} quant files below" if fit.quants else ""
    print(f"model            {fit.source} ({est.architecture}, {est.model_type}{quant})")
    print(f"parameters       {_count(est.total_params)} total, {_count(est.active_params)} active per token")
    if est.num_moe_layers:
        print(f"experts          {est.num_experts} per layer x {est.num_moe_layers} MoE layers, top-{est.top_k}; "
              f"{format_bytes(est.bytes_per_expert)} per expert ({est.dtype})")
        print(f"all experts      {format_bytes(est.all_expert_bytes)}")
    print(f"dense weights    {format_bytes(est.dense_bytes)}")
    if est.num_moe_layers:
        print(f"minimum budget   {format_bytes(est.min_budget_bytes)}")
    print(f"files            {fit.files}")
    print(f"this machine     {_machine_line(fit.machine, cache_dir).removeprefix('this machine: ')}")
    print(f"verdict          {fit.verdict.headline}")
    formats = fit.formats
    if summary := format_summary(formats):  # the format decides how the model runs here
        print(f"by format        {summary}")
        for verdict in formats[1:]:  # the original is the verdict above
            print(f"  {verdict.words:<6s} experts {format_bytes(verdict.estimate.all_expert_bytes):>10s}: "
                  f"{verdict.verdict.headline} (--expert-format {verdict.format})")
    for quant in fit.quants:  # a GGUF repo: the verdict above is the recommended file's
        here = "downloaded" if quant.local_path else f"--quant {quant.label}"
        print(f"  {quant.label:<10s} {format_bytes(quant.size):>10s}: {quant.verdict.headline} ({here})")
    for line in fit.notes:
        print(f"note             {line}")
    return 0


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _machine_line(machine, cache_dir: Path) -> str:
    from engine.accounting.sizes import format_bytes

    gpu = (f"{machine.gpu_name} {format_bytes(machine.vram_free)} free" + ("" if machine.cuda_usable else " (no CUDA in PyTorch)")
           if machine.gpu_name else "no GPU")
    return (f"this machine: {format_bytes(machine.ram_available)} RAM available of {format_bytes(machine.ram_total)}, "
            f"{gpu}, {format_bytes(machine.disk_free)} free disk at {cache_dir}")


# ----------------------------------------------------------------------------- download


def _download(args: argparse.Namespace) -> int:
    from engine.hub.download import download_model
    from engine.hub.errors import HubError
    from engine.hub.fit import remote_fit
    from engine.hub.machine import probe_machine
    from engine.hub.paths import hub_cache_dir
    from engine.hub.remote_gguf import pick_choice

    cache_dir = hub_cache_dir()
    fit = remote_fit(args.repo, args.revision, probe_machine(cache_dir), cache_dir)
    remote, est, verdict = fit.remote, fit.estimate, fit.verdict
    if fit.quants:  # a GGUF repo: only the quant file (set) asked for
        choice = pick_choice(remote, args.quant or "")
        remote.files = choice.files
        picked = next(q for q in fit.quants if q.label == choice.label)
        est, verdict = picked.estimate, picked.verdict
    print(f"{args.repo}: {verdict.headline}", file=sys.stderr)
    if est.problem and not args.force:
        raise HubError(f"MoEScope cannot run '{args.repo}' ({est.problem}); pass --force to download it anyway")
    progress = TerminalProgress()
    try:
        snapshot = download_model(args.repo, revision=args.revision, cache_dir=cache_dir, remote=remote,
                                  on_progress=progress)
    except KeyboardInterrupt:
        progress.close()
        print("download interrupted; finished files are kept: run the same command to continue", file=sys.stderr)
        return 130
    finally:
        progress.close()
    print(snapshot)
    budget = f" --budget {verdict.budget_arg}" if verdict.budget_arg else ""
    print(f"chat with it: moescope chat --model {snapshot}{budget}", file=sys.stderr)
    return 0


class TerminalProgress:
    """A one-line progress bar on stderr (a line per file when stderr is not a terminal)."""

    WIDTH = 30

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_file = None
        self.open_line = False

    def __call__(self, p) -> None:
        from engine.accounting.sizes import format_bytes
        from engine.hub.download import format_eta

        if p.finished:
            self.close()
            print(p.message, file=self.stream)
            return
        if not self.tty:
            if p.filename != self.last_file:
                self.last_file = p.filename
                print(f"[{p.files_done + 1}/{p.files_total}] {p.filename}", file=self.stream)
            return
        filled = int(self.WIDTH * p.fraction)
        eta = "" if p.eta_s is None else f" ETA {format_eta(p.eta_s)}"
        line = (f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {p.fraction:4.0%} {format_bytes(p.bytes_done)}/"
                f"{format_bytes(p.bytes_total)} {format_bytes(p.bytes_per_s)}/s{eta} {p.filename}")
        columns = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write(line[: columns + 1].ljust(columns + 1))  # "\r" + the line, blanking the previous one
        self.stream.flush()
        self.open_line = True

    def close(self) -> None:
        if self.open_line:
            self.stream.write("\n")
            self.stream.flush()
            self.open_line = False


# ----------------------------------------------------------------------------- remove


def _remove(args: argparse.Namespace) -> int:
    from engine.accounting.sizes import format_bytes
    from engine.hub.local import remove_cached
    from engine.hub.paths import hub_cache_dir

    cache_dir = hub_cache_dir()
    freed = remove_cached(args.repo, cache_dir, execute=args.yes)
    if not args.yes:
        print(f"moescope: '{args.repo}' ({format_bytes(freed)}) would be deleted from {cache_dir}; "
              "pass --yes to delete it", file=sys.stderr)
        return 1
    print(f"deleted '{args.repo}' from {cache_dir}: {format_bytes(freed)} freed")
    return 0
