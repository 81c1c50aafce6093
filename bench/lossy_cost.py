"""The quality cost of the lossy policy (swapmoe) against a lossless one, on the demo model.

swapmoe restricts each router to the experts already resident, so it never misses — and its
answers change. This measures by how much, at the budgets the speed benchmark uses:
- perplexity of the answers of held-out demo chats, given their questions, through the engine;
- held-out greedy accuracy per skill (the model card's metric).
A lossless policy (lru) at the same budget equals the model itself, so it is the reference.

    python -m bench.lossy_cost [--budgets 25,50] [--n 20] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.output import RESULTS_DIR, result_stem

os.environ.setdefault("HF_HUB_OFFLINE", "1")



def answer_perplexity(runtime, n_per_skill: int) -> float:
    """exp(mean NLL) of the assistant's answer tokens of held-out chats, given the question.

    Only answers are scored: the demo model is trained on answers only, so its predictions of the
    user's words are meaningless.
    """
    import math

    import torch
    import torch.nn.functional as F

    from engine.demo.corpus import SKILLS, heldout

    total, count = 0.0, 0
    with torch.inference_mode():
        for skill in SKILLS:
            for ex in heldout(skill, n_per_skill):
                question = runtime.tokenizer.apply_chat_template([{"role": "user", "content": ex.user}],
                                                                 add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)
                chat = runtime.tokenizer.apply_chat_template(
                    [{"role": "user", "content": ex.user}, {"role": "assistant", "content": ex.assistant}],
                    tokenize=True, return_dict=False)
                ids = torch.tensor([chat])
                logits = runtime.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
                runtime.counters.end_token()
                runtime.cache.policy.on_token_end()
                start, end = len(question), ids.shape[1] - 1  # the answer through <|im_end|>, not the newline after
                total += float(F.cross_entropy(logits[0, start - 1 : end - 1].float(), ids[0, start:end], reduction="sum"))
                count += end - start
    return math.exp(total / count)


def measure(policy: str, budget: str, n: int) -> dict:
    from engine.decode.runtime import MoERuntime
    from engine.demo.corpus import SKILLS, heldout
    from engine.demo.engine_backend import engine_answer_fn
    from engine.demo.evaluate import accuracy_per_skill
    from engine.protocol import LoadModel

    runtime = MoERuntime(LoadModel(path="demo", budget=budget, store="ram", policy=policy))
    try:
        ppl = answer_perplexity(runtime, n)
        acc = accuracy_per_skill(engine_answer_fn(runtime), {s: heldout(s, n) for s in SKILLS})
    finally:
        runtime.close()
    return {"policy": policy, "budget": budget, "perplexity": ppl,
            "accuracy": {s: r["accuracy"] for s, r in acc.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lossy_cost")
    parser.add_argument("--budgets", default="25,50")
    parser.add_argument("--n", type=int, default=20, help="held-out questions per skill")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    rows = []
    for budget in args.budgets.split(","):
        for policy in ("lru", "swapmoe"):
            row = measure(policy, f"{budget}%", args.n)
            rows.append(row)
            mean_acc = sum(row["accuracy"].values()) / len(row["accuracy"])
            print(f"{policy:8s} {budget:>3s}%  perplexity {row['perplexity']:.3f}  mean accuracy {mean_acc:.3f}", flush=True)
    write(rows, args)
    return 0


def write(rows: list[dict], args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = result_stem("lossy-cost")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    skills = list(rows[0]["accuracy"])
    lines = [f"Quality cost of the lossy policy on the demo model — {args.n} held-out questions per skill, greedy.", "",
             "| policy | budget | answer perplexity | mean accuracy | " + " | ".join(skills) + " |",
             "|---" * (4 + len(skills)) + "|"]
    for r in rows:
        acc = r["accuracy"]
        lines.append(f"| {r['policy']}{' (lossy)' if r['policy'] == 'swapmoe' else ''} | {r['budget']} | "
                     f"{r['perplexity']:.3f} | {sum(acc.values()) / len(acc):.3f} | "
                     + " | ".join(f"{acc[s]:.2f}" for s in skills) + " |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
