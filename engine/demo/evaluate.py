"""Evaluate the demo model: held-out accuracy per skill and expert specialisation.

    python -m engine.demo.evaluate [--model resources/models/demo] [--n 50] [--json out.json]

The metric functions take plain data (an answer callable, per-skill usage arrays of shape
[layers, experts]) so any backend can feed them, e.g. the offloading engine. The
``hf_*`` helpers are the plain-transformers reference backend.

Jensen-Shannon divergence is in bits (log base 2), so it lies in [0, 1].
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from engine.demo.corpus import SKILLS, Example, heldout
from engine.system.process_settings import apply_process_settings

# Takes a batch of user messages (single-turn chats), returns the assistant replies.
AnswerFn = Callable[[Sequence[str]], list[str]]


# --- metrics on plain data ---------------------------------------------------------------


def accuracy_per_skill(answer: AnswerFn, examples: Mapping[str, Sequence[Example]]) -> dict[str, dict]:
    """Greedy exact match (after stripping whitespace) per skill."""
    report: dict[str, dict] = {}
    for skill, exs in examples.items():
        replies = answer([e.user for e in exs])
        wrong = [
            {"user": e.user, "expected": e.assistant, "got": r.strip()}
            for e, r in zip(exs, replies, strict=True)
            if r.strip() != e.assistant.strip()
        ]
        n = len(exs)
        report[skill] = {"n": n, "correct": n - len(wrong), "accuracy": (n - len(wrong)) / max(n, 1), "wrong": wrong}
    return report


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits between two (unnormalised) distributions."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a: np.ndarray, b: np.ndarray) -> float:
        nz = a > 0  # 0 * log(0 / x) = 0; b > 0 wherever a > 0 since b = m here
        return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def specialisation(usage: Mapping[str, np.ndarray]) -> dict:
    """Pairwise layer-averaged JS divergence between skills' expert-usage distributions.

    ``usage[skill]`` has shape [layers, experts]: how often each expert was in the top-k
    over that skill's prompt tokens, per layer.
    """
    skills = list(usage)
    pairs: dict[str, float] = {}
    per_layer_pairs: list[np.ndarray] = []
    for a, b in itertools.combinations(skills, 2):
        ua, ub = np.asarray(usage[a]), np.asarray(usage[b])
        layer_js = np.array([js_divergence(ua[i], ub[i]) for i in range(ua.shape[0])])
        per_layer_pairs.append(layer_js)
        pairs[f"{a}|{b}"] = float(layer_js.mean())
    per_layer = np.mean(per_layer_pairs, axis=0) if per_layer_pairs else np.zeros(0)
    return {
        "unit": "bits (log2), range [0, 1]",
        "pairs": pairs,
        "mean": float(np.mean(list(pairs.values()))) if pairs else 0.0,
        "min_pair": min(pairs.items(), key=lambda kv: kv[1]) if pairs else None,
        "mean_per_layer": [float(v) for v in per_layer],
    }


# --- plain-transformers backend ----------------------------------------------------------


def _prompts(tok, users: Sequence[str]) -> list[str]:
    return [
        tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True)
        for u in users
    ]


def hf_answer_fn(model, tok, batch_size: int = 32, max_new_tokens: int = 48) -> AnswerFn:
    """Greedy `generate` with the chat template, stopping at EOS."""
    import torch

    tok.padding_side = "left"  # generation continues from the right end

    def answer(users: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(users), batch_size):
            batch = tok(_prompts(tok, users[i : i + batch_size]), return_tensors="pt", padding=True,
                        add_special_tokens=False)  # fmt: skip
            with torch.no_grad():
                gen = model.generate(
                    **batch,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            new = gen[:, batch["input_ids"].shape[1] :]
            out += [s.strip() for s in tok.batch_decode(new, skip_special_tokens=True)]
        return out

    return answer


def hf_expert_usage(model, tok, users: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """Top-k expert selection counts over the templated prompt tokens: [layers, experts]."""
    import torch

    cfg = model.config
    n_exp, top_k = cfg.num_experts, cfg.num_experts_per_tok
    counts = np.zeros((cfg.num_hidden_layers, n_exp), dtype=np.int64)
    tok.padding_side = "left"
    for i in range(0, len(users), batch_size):
        batch = tok(_prompts(tok, users[i : i + batch_size]), return_tensors="pt", padding=True,
                    add_special_tokens=False)  # fmt: skip
        with torch.no_grad():
            res = model(**batch, output_router_logits=True, use_cache=False)
        real = batch["attention_mask"].reshape(-1).bool()  # router logits are [batch*seq, experts]
        for layer, logits in enumerate(res.router_logits):
            idx = logits[real].topk(top_k, dim=-1).indices.reshape(-1)
            counts[layer] += np.bincount(idx.numpy(), minlength=n_exp)
    return counts


# --- CLI ---------------------------------------------------------------------------------


def evaluate(model_dir: str | Path, n: int = 50, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = {s: heldout(s, n, seed) for s in SKILLS}
    acc = accuracy_per_skill(hf_answer_fn(model, tok), examples)
    usage = {s: hf_expert_usage(model, tok, [e.user for e in exs]) for s, exs in examples.items()}
    spec = specialisation(usage)
    return {
        "model": str(model_dir),
        "n_per_skill": n,
        "heldout_seed": seed,
        "accuracy": acc,
        "specialisation": spec,
        "usage": {s: u.tolist() for s, u in usage.items()},
    }


def print_report(rep: dict) -> None:
    acc = rep["accuracy"]
    print(f"{'skill':<14}{'n':>5}{'correct':>9}{'accuracy':>10}")
    for skill, r in acc.items():
        print(f"{skill:<14}{r['n']:>5}{r['correct']:>9}{r['accuracy']:>10.1%}")
    for skill, r in acc.items():
        for w in r["wrong"][:3]:
            print(f"  x {skill}: {w['user']!r} expected {w['expected']!r} got {w['got']!r}")
    spec = rep["specialisation"]
    skills = list(rep["usage"])
    print(f"\nlayer-averaged Jensen-Shannon divergence between skills ({spec['unit']}):")
    print(" " * 14 + "".join(f"{s[:7]:>8}" for s in skills))
    for a in skills:
        row = []
        for b in skills:
            key = f"{a}|{b}" if f"{a}|{b}" in spec["pairs"] else f"{b}|{a}"
            row.append("       -" if a == b else f"{spec['pairs'][key]:8.3f}")
        print(f"{a:<14}" + "".join(row))
    print(f"mean over pairs: {spec['mean']:.3f}   min pair: {spec['min_pair'][0]} {spec['min_pair'][1]:.3f}")
    print("mean per layer: " + ", ".join(f"{v:.3f}" for v in spec["mean_per_layer"]))
    min_acc = min(r["accuracy"] for r in acc.values())
    ok = min_acc >= 0.9 and spec["mean"] > 0.1
    print(f"\ngoals (every skill >= 90%, mean JS > 0.1): {'PASS' if ok else 'FAIL'} (min accuracy {min_acc:.1%})")


def main(argv: list[str] | None = None) -> None:
    apply_process_settings()  # before anything computes
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resources/models/demo")
    ap.add_argument("--n", type=int, default=50, help="held-out questions per skill (fewer if a skill has fewer)")
    ap.add_argument("--seed", type=int, default=0, help="seed for drawing held-out questions")
    ap.add_argument("--json", type=Path, help="also write the full report here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo model is local; never reach the hub
    rep = evaluate(args.model, args.n, args.seed)
    print_report(rep)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=2) + "\n")


if __name__ == "__main__":
    main()
