"""The family sweep: every decorated MoE family in the installed transformers, offloaded, against stock.

For each family (`bench.family_checkpoints`): build a tiny random checkpoint, generate greedily in
float32 with stock transformers, then with MoEScope at budgets 30 % and `all`, disk and RAM
stores, on transformers' kernels (`--exact`), and compare token for token; check that the reply
really went through the experts (the cache counted hits or misses). A bfloat16 run with the
default settings records which decode path a decode token takes. Every failure keeps its message.

    python -m bench.family_sweep [--only NAME ...] [--out docs/families.md]

writes the table to docs/families.md and the family count into the README.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.family_checkpoints import Family, families, save_family_checkpoint
from engine.system.process_settings import apply_process_settings

PROMPT = [1, 17, 42, 9, 77, 5, 63, 30, 11]
NEW_TOKENS = 8
RUNS = (("30%", "disk"), ("30%", "ram"), ("all", "disk"), ("all", "ram"))
ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
COUNT_MARK = re.compile(r"<!-- family-count -->.*?<!-- /family-count -->", re.S)


@dataclass
class FamilyResult:
    family: str
    model_type: str = ""
    model_class: str = ""
    multimodal: bool = False
    built: bool = False
    runs: dict[str, str] = field(default_factory=dict)  # "30% disk" -> exact | differs | error | not routed
    decode_path: str = ""
    failure: str = ""  # the first thing that went wrong, in the words it was said

    @property
    def exact(self) -> bool:
        return self.built and bool(self.runs) and all(v == "exact" for v in self.runs.values())


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def reference_tokens(family: Family, path: Path) -> list[int]:
    """Stock transformers, everything in memory, greedy, with the family's own class (or, where that class
    only orchestrates submodules, the one that writes text: Qwen3-Omni's own generate(return_audio=False)
    calls its thinker's generate)."""
    from engine.decode.block_diffusion import GREEDY_SEED
    from engine.model.model_class import text_generator

    _, model = text_generator(family.model_class.from_pretrained(path, dtype=torch.float32))
    ids = torch.tensor([PROMPT])
    torch.manual_seed(GREEDY_SEED)  # a block-diffusion model draws random canvases; MoEScope seeds a greedy reply so
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         pad_token_id=0)
    out = getattr(out, "sequences", out)  # a block-diffusion model's generate returns an output object
    return out[0, len(PROMPT):len(PROMPT) + NEW_TOKENS].tolist()  # (of which a whole block)


def offloaded_run(path: Path, budget: str, store: str, *, exact: bool = True, dtype: str = "float32",
                  new_tokens: int = NEW_TOKENS):
    """(token ids, reply stats, decode path label and why not a faster one) from MoEScope."""
    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    runtime = MoERuntime(LoadModel(path=str(path), budget=budget, store=store, dtype=dtype, fast_decode=not exact))
    try:
        result = Generator(runtime).generate(PROMPT, SamplingSettings(temperature=0, max_new_tokens=new_tokens))
        return result.token_ids, result.stats, runtime.decode_path, runtime.decode_path_reason
    finally:
        runtime.close()


def sweep_family(family: Family, root: Path, *, runs: tuple[tuple[str, str], ...] = RUNS,
                 decode_path: bool = True) -> FamilyResult:
    result = FamilyResult(family.name, family.model_type or "", getattr(family.model_class, "__name__", ""),
                          family.multimodal)
    if family.problem:
        result.failure = family.problem
        return result
    path = root / family.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            built = save_family_checkpoint(family, path)
        except Exception as exc:  # a family the rules cannot shrink: listed with the reason
            result.failure = f"cannot build a tiny checkpoint: {_one_line(exc)}"
            return result
        if not built.experts_modules:
            result.failure = "the tiny checkpoint has no MoE layer (the shrink rules kept only dense layers)"
            return result
        result.built = True
        try:
            reference = reference_tokens(family, path)
        except Exception as exc:
            result.failure = f"stock transformers cannot generate with it: {_one_line(exc)}"
            return result
        for budget, store in runs:
            key = f"{budget} {store}"
            try:
                ids, stats, _, _ = offloaded_run(path, budget, store)
            except Exception as exc:
                result.runs[key] = "error"
                result.failure = result.failure or _one_line(exc)
                continue
            if stats.hits + stats.misses == 0:
                result.runs[key] = "not routed"
                result.failure = result.failure or "the reply never went through the expert cache"
            elif ids != reference:
                result.runs[key] = "differs"
                result.failure = result.failure or f"{key}: {ids} != stock {reference}"
            else:
                result.runs[key] = "exact"
        if decode_path and result.exact:
            try:
                _, _, label, reason = offloaded_run(path, "all", "ram", exact=False, dtype="bfloat16", new_tokens=3)
                result.decode_path = label + (f" ({reason})" if reason else "")
            except Exception as exc:
                result.decode_path = f"error: {_one_line(exc)}"
    return result


def _cell(result: FamilyResult, key: str) -> str:
    value = result.runs.get(key, "–")
    return "✓" if value == "exact" else value


def render(results: list[FamilyResult]) -> str:
    import transformers

    runnable = [r for r in results if r.model_class]
    exact = [r for r in results if r.exact]
    lines = [
        "# MoE families in transformers",
        "",
        f"Every experts class decorated with `@use_experts_implementation` in transformers {transformers.__version__}, "
        "one row per model family, from `python -m bench.family_sweep` (which also writes the count into the "
        "README). Each family gets a tiny random checkpoint from its own config class (`bench/family_checkpoints.py`: "
        "shrink rules on field names plus a few per-family overrides); MoEScope's greedy float32 output with "
        f"`--exact` is compared with stock transformers over {NEW_TOKENS} tokens at budgets 30 % and `all`, on the "
        "disk and RAM stores. ✓: the same tokens, and the reply went through the expert cache. "
        "Decode path: what a bfloat16 decode token ran on with the default settings (and why not a faster path).",
        "",
        f"**{len(exact)} of {len(runnable)} families that generate text run exactly** "
        f"({len(results)} decorated families; without a text-generating class: {len(results) - len(runnable)}).",
        "Multimodal families run text-only chat through their conditional-generation class (images are a later step).",
        "",
        "| family | model type | class | " + " | ".join(f"{b} {s}" for b, s in RUNS) + " | decode path | what went wrong |",
        "|---|---|---|" + "---|" * len(RUNS) + "---|---|",
    ]
    for r in results:
        cls = r.model_class + (" (text only)" if r.multimodal and r.model_class else "")
        cells = [_cell(r, f"{b} {s}") for b, s in RUNS] if r.built else ["not built"] + ["–"] * (len(RUNS) - 1)
        failure = r.failure.replace("|", "\\|")
        lines.append(f"| {r.family} | {r.model_type} | {cls} | " + " | ".join(cells)
                     + f" | {r.decode_path.replace('|', '/')} | {failure} |")
    return "\n".join(lines) + "\n"


def family_count_sentence(results: list[FamilyResult]) -> str:
    runnable = sum(1 for r in results if r.model_class)
    exact = sum(1 for r in results if r.exact)
    return f"<!-- family-count -->{exact} of the {runnable}<!-- /family-count -->"


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.family_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these families only (transformers' models package names); "
                                                  "the table and README are not written")
    parser.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    found = families()
    if args.only:
        unknown = set(args.only) - {f.name for f in found}
        if unknown:
            print(f"unknown families: {', '.join(sorted(unknown))}; see docs/families.md for the names", file=sys.stderr)
            return 2
        found = [f for f in found if f.name in args.only]
    results = []
    with tempfile.TemporaryDirectory(prefix="moescope-sweep-") as root:
        for family in found:
            result = sweep_family(family, Path(root))
            results.append(result)
            status = "exact" if result.exact else (result.failure or "?")
            print(f"{family.name:24s} {status}", flush=True)
    if not args.only:
        args.out.write_text(render(results), encoding="utf-8")
        readme = README.read_text(encoding="utf-8")
        README.write_text(COUNT_MARK.sub(family_count_sentence(results), readme), encoding="utf-8")
        print(f"wrote {args.out} and the count in {README.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
