"""`python -m bench.record_demo_traces`: record the demo model's routing on its held-out questions.

Writes `bench/traces/demo-heldout-mixed.jsonl` and `demo-heldout-by-skill.jsonl`: the same
questions (`QUESTIONS_PER_SKILL` held-out questions of each claimed skill, `engine.demo.corpus`,
seed 0), answered greedily through the engine at budget `all` (routing does not depend on the
budget with a lossless policy), one request per question: once in a seeded shuffled order, once
grouped by skill (a user asking several questions of one kind in a row). The traces are
MoEScope's own format, with the router lookahead `p` that `promoe` replays. Deterministic on CPU:
running it again rewrites the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from engine.system.process_settings import apply_process_settings

TRACES = Path(__file__).resolve().parent / "traces"
QUESTIONS_PER_SKILL = 4


def questions(per_skill: int) -> list[tuple[str, str]]:
    """(skill, question) for every claimed skill of the demo model, grouped by skill."""
    from engine.demo.corpus import heldout
    from resources import DEMO_MODEL_DIR

    skills = json.loads((DEMO_MODEL_DIR / "moescope_demo.json").read_text())["skills"]
    return [(skill, ex.user) for skill in skills for ex in heldout(skill, per_skill, seed=0)]


def record(path: Path, asked: list[tuple[str, str]], max_new_tokens: int) -> None:
    import torch

    from engine.decode.generation import Generator
    from engine.decode.runtime import MoERuntime
    from engine.protocol import LoadModel, SamplingSettings

    torch.set_num_threads(1)  # the same sums in the same order on every machine
    runtime = MoERuntime(LoadModel(path="demo", budget="all", store="disk", trace=str(path)))
    generator = Generator(runtime)
    settings = SamplingSettings(temperature=0, max_new_tokens=max_new_tokens)
    for skill, user in asked:
        result = generator.generate(generator.encode_chat([{"role": "user", "content": user}]), settings)
        print(f"  {skill:14s} {user!r} -> {result.text!r}")
    runtime.close()


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.record_demo_traces")
    parser.add_argument("--per-skill", type=int, default=QUESTIONS_PER_SKILL, help="held-out questions per skill")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=TRACES)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    grouped = questions(args.per_skill)
    mixed = list(grouped)
    random.Random(0).shuffle(mixed)
    for name, asked in (("demo-heldout-mixed", mixed), ("demo-heldout-by-skill", grouped)):
        path = args.out / f"{name}.jsonl"
        print(f"{path}: {len(asked)} requests")
        record(path, asked, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
