"""The quality cost of what MoEScope may trade accuracy for, on the demo model: the lossy policy
(swapmoe) at a budget, and the block weight formats of the experts and of the dense layers.

Every row is measured through the engine against the float model (the checkpoint's own float32
weights, lossless `lru`, budget `all`) on the held-out questions of every skill:
- held-out greedy accuracy per skill (the model card's metric), and its difference from the float
  model in points;
- teacher-forced on the held-out chats (question and reference answer, the same tokens for every
  row, so every row scores the same positions): the mean KL(float || row) of the next-token
  distributions over the answer tokens (nats), how often both pick the same most likely token,
  and the answers' perplexity.

Greedy decoding, budget `all` for the formats, and the exact path (transformers' kernels on the
dequantized weights, the fast native kernels switched off) so the numbers describe the format, not a
kernel, unless `--kernels` asks for the native ones (`fast`, in bf16) or for them with the lossy
8-bit inputs (`fast-int8`: K-quant matrices, prompts and decode). Both kinds of score go through the
engine's paths: the teacher-forced chats are read as prompts (`MoERuntime.prompt_logits`), the
greedy answers are decoded, so each sees --int8-inputs where it runs. Where a format's block does not divide a matrix's width the engine stores it in
llama.cpp's fallback format; the table says what each matrix actually got.

    python -m bench.lossy_cost [--budgets 25,50] [--n 20]
    python -m bench.lossy_cost --formats q8_0,q4_k,q2_k [--dense-formats original,q8_0] [--n 50]
        [--card resources/models/demo/moescope_demo.json]
    python -m bench.lossy_cost --formats q4_k --kernels fast,fast-int8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.output import RESULTS_DIR, write_report
from engine.system.process_settings import apply_process_settings

# The goals, in points of held-out accuracy on each claimed skill, by expert format.
GOAL_POINTS = {"q8_0": 2.0, "q4_k": 5.0, "q4_0": 5.0}


@dataclass(frozen=True)
class Setting:
    policy: str = "lru"
    budget: str = "all"
    expert_format: str = "original"
    dense_format: str = "original"
    # exact: transformers' kernels (the float32 model as shipped); fast: the native kernels (bf16);
    # fast-int8: those with the opt-in lossy 8-bit inputs (K-quant matrices, prompts and decode)
    kernels: str = "exact"

    @property
    def lossy_policy(self) -> bool:
        return self.policy == "swapmoe"


FLOAT = Setting()


def canonical_format(name: str) -> str:
    """`4bit` -> `q4_k`, `bf16` -> `original`; an unknown name is refused with the choices."""
    from engine.formats.blocks import format_name, parse_format

    try:
        return format_name(parse_format(name))
    except ValueError as exc:
        raise SystemExit(f"python -m bench.lossy_cost: {exc}") from None


def stored_formats(runtime) -> dict:
    """What each matrix was actually stored as, after the engine's fallbacks for narrow matrices."""
    from engine.model.dense_quantize import QuantizedLinear

    layout = runtime.layout
    experts = {p.name: p.fmt.name if p.fmt is not None else str(p.dtype).removeprefix("torch.") for p in layout.params}
    weights = sum(math.prod(p.shape) for p in layout.params)
    stored_bytes = sum(p.nbytes for p in layout.params)  # not slot_bytes: a slot is padded for alignment
    dense = Counter(m.fmt.name for m in runtime.model.modules() if isinstance(m, QuantizedLinear))
    return {"experts_stored_as": experts, "expert_bits_per_weight": stored_bytes * 8 / weights,
            "dense_stored_as": dict(dense) or {str(runtime.dtype).removeprefix("torch."): 0},
            "format_notes": list(runtime.format_notes)}


def measure(setting: Setting, n: int, reference: dict | None) -> dict:
    """One row; `reference` is the float model's row (None while measuring the float model itself),
    and the float row keeps its log-probabilities for the rows after it."""
    from bench.answer_scores import answer_logprobs, compare, heldout_chats
    from engine.decode.native import kernels as native
    from engine.decode.native.testing import forced_paths
    from engine.decode.runtime import MoERuntime
    from engine.demo.corpus import SKILLS, heldout
    from engine.demo.engine_backend import engine_answer_fn
    from engine.demo.evaluate import accuracy_per_skill
    from engine.protocol import LoadModel

    fast = setting.kernels != "exact"  # the native kernels compute bf16 weights
    runtime = MoERuntime(LoadModel(path="demo", budget=setting.budget, store="ram", policy=setting.policy,
                                   expert_format=setting.expert_format, dense_format=setting.dense_format,
                                   dtype="bfloat16" if fast else "auto", fast_decode=fast,
                                   int8_inputs=setting.kernels == "fast-int8"))
    # Beside AMX tiles the prompt path sets the 8-bit inputs aside (faster without them); their cost is
    # measured as they run where they apply, on the dot products.
    kernels = native.load() if setting.kernels == "fast-int8" else None
    with forced_paths(kernels, amx=False) if kernels is not None else nullcontext():
        try:
            runtime.set_fast_decode(fast)  # exact: transformers' kernels, whatever the load default is
            chats = heldout_chats(runtime.tokenizer, SKILLS, n)
            logprobs = answer_logprobs(runtime, chats)
            scores = compare(chats, reference["logprobs"] if reference else logprobs, logprobs)
            acc = accuracy_per_skill(engine_answer_fn(runtime), {s: heldout(s, n) for s in SKILLS})
            row = {**asdict(setting), **stored_formats(runtime), **asdict(scores), "decode_path": runtime.decode_path,
                   "accuracy": {s: r["accuracy"] for s, r in acc.items()},
                   "questions": {s: r["n"] for s, r in acc.items()}}
        finally:
            runtime.close()
    base = reference["accuracy"] if reference else row["accuracy"]
    row["delta_points"] = {s: 100 * (a - base[s]) for s, a in row["accuracy"].items()}
    if reference is None:
        row["logprobs"] = logprobs
    return row


def claimed_skills() -> list[str]:
    from resources import DEMO_MODEL_DIR

    return json.loads((DEMO_MODEL_DIR / "moescope_demo.json").read_text())["skills"]


def summarise(row: dict, claimed: list[str], setting: Setting) -> None:
    """Accuracy over the claimed skills, and the issue's goal this row is held to (if any): a
    format row, with a limit for its expert format and for its dense format (original: none)."""
    deltas = [row["delta_points"][s] for s in claimed]
    row["claimed_mean_accuracy"] = sum(row["accuracy"][s] for s in claimed) / len(claimed)
    row["claimed_mean_delta_points"] = sum(deltas) / len(deltas)
    row["worst_claimed_delta_points"] = max(deltas, key=abs)
    limits = [GOAL_POINTS.get(setting.expert_format),
              0.0 if setting.dense_format == "original" else GOAL_POINTS.get(setting.dense_format)]
    goal = None if None in limits or setting.lossy_policy else max(limits)
    row["goal_points"] = goal
    row["goal_met"] = None if goal is None else abs(row["worst_claimed_delta_points"]) <= goal


def settings_from(args) -> list[Setting]:
    settings = [FLOAT]
    for budget in args.budgets.split(",") if args.budgets else []:
        settings += [Setting("lru", f"{budget}%"), Setting("swapmoe", f"{budget}%")]
    formats = [canonical_format(f) for f in args.formats.split(",")] if args.formats else []
    dense = [canonical_format(f) for f in args.dense_formats.split(",")]
    kernels = args.kernels.split(",")
    settings += [Setting(expert_format=e, dense_format=d, kernels=k) for e in formats for d in dense for k in kernels]
    return list(dict.fromkeys(settings))  # the float model once


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo model is local; never reach the hub
    parser = argparse.ArgumentParser(prog="python -m bench.lossy_cost",
                                     description="Quality cost of the lossy policy and the weight formats on the "
                                                 "demo model, against the float model.")
    parser.add_argument("--budgets", default=None,
                        help="budgets in %% for lru and swapmoe (default 25,50 when no --formats is given)")
    parser.add_argument("--formats", default=None, help="expert formats, e.g. q8_0,q6_k,q4_k,q3_k,q2_k or 8bit,4bit")
    parser.add_argument("--dense-formats", default="original", help="dense formats, each with every expert format")
    parser.add_argument("--kernels", default="exact", help="for the format rows: exact (transformers' kernels, the "
                        "model's float32), fast (the native kernels, bf16) and/or fast-int8 (those with the lossy "
                        "--int8-inputs), comma-separated")
    parser.add_argument("--n", type=int, default=20, help="held-out questions per skill (fewer where a skill has fewer)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--card", type=Path, help="also write the format rows into this model card JSON "
                                                  "(resources/models/demo/moescope_demo.json)")
    args = parser.parse_args(argv)
    if args.budgets is None and not args.formats:
        args.budgets = "25,50"
    claimed = claimed_skills()
    rows: list[dict] = []
    for setting in settings_from(args):
        row = measure(setting, args.n, rows[0] if rows else None)
        summarise(row, claimed, setting)
        rows.append(row)
        print(f"{row_label(row):32s} perplexity {row['perplexity']:.3f}  KL {row['kl_mean']:.2e}  "
              f"claimed-skill accuracy {row['claimed_mean_accuracy']:.3f} "
              f"({row['claimed_mean_delta_points']:+.1f} points)", flush=True)
    rows[0].pop("logprobs")
    kind = "format-quality" if args.formats else "lossy-cost"
    write_report(args.out, kind, {"n_per_skill": args.n, "claimed_skills": claimed, "rows": rows},
                 table(rows, claimed, args.n))
    if args.card:
        write_card(args.card, rows, args.n, argv if argv is not None else sys.argv[1:])
    return 0


def row_label(row: dict) -> str:
    if row["policy"] != "lru" or row["budget"] != "all":
        return f"{row['policy']} {row['budget']}"
    kernels = "" if row.get("kernels", "exact") == "exact" else f", {row['kernels']} kernels"
    return f"experts {row['expert_format']}, dense {row['dense_format']}{kernels}"


def stored_label(row: dict) -> tuple[str, str]:
    experts = ", ".join(f"{name} {fmt}" for name, fmt in row["experts_stored_as"].items())
    dense = ", ".join(f"{fmt} x{count}" if count else fmt for fmt, count in row["dense_stored_as"].items())
    return experts, dense


def table(rows: list[dict], claimed: list[str], n: int) -> list[str]:
    skills = list(rows[0]["accuracy"])
    lines = [f"Quality cost on the demo model against the float model (float32, lru, budget `all`): up to {n} "
             "held-out questions per skill, greedy, exact path (transformers' kernels on the dequantized weights) "
             "unless a row names other kernels (fast: the native kernels in bf16; fast-int8: with --int8-inputs). "
             "KL(float || row) in nats, mean over the answer tokens of the held-out chats, teacher-forced on the "
             "reference answers; 'same top' is the share of those positions where both pick the same token. "
             "Accuracy in %, per skill (difference from the float model in points); 'claimed' = the "
             f"{len(claimed)} skills the model card claims; the goal is the largest |difference| on a claimed "
             "skill.", "",
             "| policy | budget | experts | dense | experts stored as | bits / expert weight | dense stored as "
             "| perplexity | mean KL | same top | claimed mean | mean diff | worst claimed diff | goal | "
             + " | ".join(skills) + " |",
             "|---" * (14 + len(skills)) + "|"]
    for r in rows:
        experts, dense = stored_label(r)
        goal = "" if r["goal_points"] is None else \
            f"<= {r['goal_points']:.0f}: {'met' if r['goal_met'] else '**missed**'}"
        per_skill = [f"{100 * r['accuracy'][s]:.0f}" + (f" ({r['delta_points'][s]:+.0f})" if r["delta_points"][s] else "")
                     for s in skills]
        lines.append(f"| {r['policy']}{' (lossy)' if r['policy'] == 'swapmoe' else ''} | {r['budget']} | "
                     f"{r['expert_format']}{'' if r['kernels'] == 'exact' else ' (' + r['kernels'] + ', bf16)'} | "
                     f"{r['dense_format']} | {experts} | {r['expert_bits_per_weight']:.2f} | "
                     f"{dense} | {r['perplexity']:.4f} | {r['kl_mean']:.2e} | {100 * r['same_top_token']:.2f} % | "
                     f"{100 * r['claimed_mean_accuracy']:.1f} | {r['claimed_mean_delta_points']:+.1f} | "
                     f"{r['worst_claimed_delta_points']:+.0f} | {goal} | " + " | ".join(per_skill) + " |")
    notes = dict.fromkeys(note for r in rows for note in r["format_notes"])
    if notes:
        lines += ["", "The engine's notes on the formats (narrow matrices take llama.cpp's fallback format):", ""]
        lines += [f"- {note}" for note in notes]
    return lines


def write_card(path: Path, rows: list[dict], n: int, argv: list[str]) -> None:
    """The format rows into the model card's JSON (`format_quality`), for the window's format picker."""
    card = json.loads(path.read_text())
    keys = ("expert_format", "dense_format", "expert_bits_per_weight", "claimed_mean_delta_points",
            "worst_claimed_delta_points", "kl_mean", "same_top_token", "perplexity")

    def card_row(row: dict) -> dict:
        experts, dense = stored_label(row)
        return {**{k: float(f"{row[k]:.5g}") if isinstance(row[k], float) else row[k] for k in keys},
                "experts_stored_as": experts, "dense_stored_as": dense}

    card["format_quality"] = {
        "measured": dt.date.today().isoformat(),
        "command": "python -m bench.lossy_cost " + " ".join(argv),
        "heldout_per_skill": n,
        "reference": "the float model as shipped (float32), exact path, budget all",
        "units": "*_delta_points: held-out greedy accuracy on the claimed skills minus the float model's, in points "
                 "(mean over skills, and the skill furthest off); kl_mean: mean KL(float || format) of the next-token "
                 "distributions over held-out answer tokens, nats",
        "rows": [card_row(r) for r in rows if r["policy"] == "lru" and r["budget"] == "all"],
    }
    path.write_text(json.dumps(card, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
