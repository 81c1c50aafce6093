"""Train the demo MoE on CPU and save it as a standard transformers checkpoint.

    python -m engine.demo.train [--out resources/models/demo] [--seed 0] [--minutes 25]

Deterministic for a given seed: model init, data and data order are all seeded, and the
step count is fixed (``--minutes`` is only a safety cap; hitting it is reported).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from engine.demo.corpus import SKILLS, Example, training_mix
from engine.demo.tokenizer import IM_END, IM_START, build_tokenizer, save_tokenizer
from engine.system.process_settings import apply_process_settings

# Harder (algorithmic) skills get more samples; memorised tables and chat need fewer.
DEFAULT_WEIGHTS: dict[str, float] = {
    "add": 1.6,
    "subtract": 2.2,
    "multiply": 2.2,
    "count_letters": 0.6,
    "reverse": 1.2,
    "spell": 0.6,
    "convert": 1.2,
    "compare": 2.5,
    "facts": 0.3,
    "chat": 0.7,
}
SKILL_NAMES: tuple[str, ...] = tuple(SKILLS)
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a tiny demo model. Answer briefly.")


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 3300
    rows: int = 16  # packed rows per step
    row_len: int = 256  # tokens per packed row
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 60
    weight_decay: float = 0.05
    aux_loss_coef: float = 0.001  # tiny: keep experts alive, but let them specialise by skill
    skill_mi_coef: float = 0.05  # weight of the skill/expert mutual-information bonus (0 = off)
    system_prompt_p: float = 0.1
    hidden: int = 128
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


def model_config(cfg: TrainConfig, tok: PreTrainedTokenizerFast) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.expert_ffn,  # unused: every layer is MoE
        moe_intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=cfg.row_len * 2,
        router_aux_loss_coef=cfg.aux_loss_coef,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


# --- data --------------------------------------------------------------------------------


def cached_encoder(tok: PreTrainedTokenizerFast) -> Callable[[str], list[int]]:
    """Memoised encode: the corpus repeats the same turn pieces many times."""

    @functools.cache
    def enc(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    return lambda text: list(enc(text))


def encode_turns(encode: Callable[[str], list[int]], messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 except on assistant answers + their EOS) for a chat."""
    ids: list[int] = []
    labels: list[int] = []
    for m in messages:
        head = encode(f"{IM_START}{m['role']}\n")
        body = encode(m["content"].strip() + IM_END)
        tail = encode("\n")
        ids += head + body + tail
        learn = m["role"] == "assistant"
        labels += [-100] * len(head) + (body if learn else [-100] * len(body)) + [-100] * len(tail)
    return ids, labels


def pack_rows(
    tok: PreTrainedTokenizerFast, examples: list[Example], cfg: TrainConfig, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack whole conversations into fixed-length rows: (input ids, labels, skill ids).

    Later conversations in a row see earlier ones as history, which doubles as multi-turn
    training: the model learns to answer the latest question. Rows start at position 0,
    like a fresh chat at inference, sometimes with a system prompt. Skill ids (index into
    SKILL_NAMES, -1 elsewhere) mark each conversation's tokens from its question onwards,
    for the skill/expert mutual-information loss.
    """
    encode = cached_encoder(tok)
    user_head = len(encode(f"{IM_START}user\n"))
    rows: list[tuple[list[int], list[int], list[int]]] = []
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ex in examples:
        ids, lab = encode_turns(
            encode, [{"role": "user", "content": ex.user}, {"role": "assistant", "content": ex.assistant}]
        )
        sk = [-1] * user_head + [SKILL_NAMES.index(ex.skill)] * (len(ids) - user_head)
        if cur[0] and len(cur[0]) + len(ids) > cfg.row_len:
            rows.append(cur)
            cur = ([], [], [])
        if not cur[0] and rng.random() < cfg.system_prompt_p:
            sys_ids, sys_lab = encode_turns(encode, [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}])
            ids, lab, sk = sys_ids + ids, sys_lab + lab, [-1] * len(sys_ids) + sk
        cur = (cur[0] + ids, cur[1] + lab, cur[2] + sk)
    if cur[0]:
        rows.append(cur)
    x = torch.full((len(rows), cfg.row_len), tok.pad_token_id, dtype=torch.long)
    y = torch.full((len(rows), cfg.row_len), -100, dtype=torch.long)
    s = torch.full((len(rows), cfg.row_len), -1, dtype=torch.long)
    for i, (a, b, c) in enumerate(rows):
        n = min(len(a), cfg.row_len)
        x[i, :n], y[i, :n], s[i, :n] = torch.tensor(a[:n]), torch.tensor(b[:n]), torch.tensor(c[:n])
    return x, y, s


def build_data(tok: PreTrainedTokenizerFast, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Conversations average ~30 tokens: draw row_len // 24 per row (a margin), then trim.
    n = cfg.steps * cfg.rows * (cfg.row_len // 24)
    examples = training_mix(cfg.weights, n, cfg.seed)
    x, y, s = pack_rows(tok, examples, cfg, random.Random(cfg.seed + 1))
    need = cfg.steps * cfg.rows
    if len(x) < need:
        raise RuntimeError(f"packed only {len(x)} rows, need {need}")
    return x[:need], y[:need], s[:need]


def check_template(tok: PreTrainedTokenizerFast) -> None:
    """Training encodes turns by hand; make sure that matches the shipped chat template."""
    msgs = [
        {"role": "system", "content": SYSTEM_PROMPTS[0]},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    want = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert encode_turns(cached_encoder(tok), msgs)[0] == list(want), "hand encoding diverges from chat template"


# --- training ----------------------------------------------------------------------------


def skill_expert_mi(router_logits: tuple[torch.Tensor, ...], skill_ids: torch.Tensor, n_skills: int) -> torch.Tensor:
    """Mutual information I(skill; expert) of the router, in nats, averaged over layers.

    Maximising it (as in Mod-Squad, Chen et al. 2023) makes each skill concentrate on a
    few experts (low H(expert | skill)) while all experts stay in use (high H(expert)):
    the specialisation the demo is meant to show. Labels are used only in training.
    """
    flat = skill_ids.reshape(-1)
    keep = flat >= 0
    onehot = torch.nn.functional.one_hot(flat[keep], n_skills).float()  # [N, K]
    n_k = onehot.sum(0)
    pi = n_k / n_k.sum()
    mis = []
    for logits in router_logits:  # each [batch*seq, experts], row-major like input_ids
        probs = logits[keep].float().softmax(-1)
        p_ke = (onehot.T @ probs) / n_k.clamp_min(1)[:, None]  # p(expert | skill)
        marg = pi @ p_ke
        h_marg = -(marg * marg.clamp_min(1e-9).log()).sum()
        h_cond = -(pi[:, None] * p_ke * p_ke.clamp_min(1e-9).log()).sum()
        mis.append(h_marg - h_cond)
    return torch.stack(mis).mean()


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def train(cfg: TrainConfig, out: Path, max_minutes: float, log_every: int = 50) -> dict:
    torch.set_num_threads(2)
    seed_everything(cfg.seed)
    tok = build_tokenizer()
    check_template(tok)
    x, y, skills = build_data(tok, cfg)
    model = Qwen3MoeForCausalLM(model_config(cfg, tok))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params / 1e6:.2f}M, rows: {len(x)}x{cfg.row_len}, steps: {cfg.steps}", flush=True)
    opt = _optimizer(model, cfg)
    t0 = time.monotonic()
    cpu0 = time.process_time()  # CPU seconds: a contention-free measure on a shared machine
    history: list[dict[str, float]] = []
    stopped_early = False
    running = [0.0, 0.0, 0.0]  # loss, aux, mi summed since the last log line
    for step in range(cfg.steps):
        sl = slice(step * cfg.rows, (step + 1) * cfg.rows)
        for i, value in enumerate(_train_step(model, opt, cfg, step, x[sl], y[sl], skills[sl])):
            running[i] += value
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            history.append(_log_line(cfg, step, running, (step % log_every) + 1, time.monotonic() - t0))
            running = [0.0, 0.0, 0.0]
        if time.monotonic() - t0 > max_minutes * 60:
            stopped_early = True
            print(f"WARNING: hit the {max_minutes} min cap at step {step + 1}; run is not the full schedule")
            break
    wall = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    save(model, tok, out)
    info = {
        "train_config": asdict(cfg),
        "params": n_params,
        "train_wall_s": round(wall, 1),
        "train_cpu_s": round(cpu, 1),
        "steps_done": history[-1]["step"] if history else 0,
        "stopped_early": stopped_early,
        "torch": torch.__version__,
        "history": history,
    }
    (out / "training_log.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {out} after {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU")
    return info


def _optimizer(model: Qwen3MoeForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only: none on norms and the router (1-D params and the gate)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "gate.weight" in n]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )


def _train_step(model: Qwen3MoeForCausalLM, opt: torch.optim.AdamW, cfg: TrainConfig, step: int,
                x: torch.Tensor, y: torch.Tensor, skills: torch.Tensor) -> tuple[float, float, float]:
    """One optimiser step on a batch of rows; its (loss, aux loss, skill-expert MI) as floats."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    want_router = cfg.aux_loss_coef > 0 or cfg.skill_mi_coef > 0
    res = model(input_ids=x, labels=y, output_router_logits=want_router)
    loss = res.loss
    mi = skill_expert_mi(res.router_logits, skills, len(SKILL_NAMES)) if cfg.skill_mi_coef > 0 else None
    if mi is not None:
        loss = loss - cfg.skill_mi_coef * mi
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return (res.loss.item(), res.aux_loss.item() if res.aux_loss is not None else 0.0,
            mi.item() if mi is not None else 0.0)


def _log_line(cfg: TrainConfig, step: int, running: list[float], steps: int, elapsed: float) -> dict[str, float]:
    """The means over the last `steps` steps, printed and returned as a history record."""
    rec = {"step": step + 1, "loss": running[0] / steps, "aux": running[1] / steps, "mi": running[2] / steps,
           "elapsed_s": elapsed}
    print(
        f"step {step + 1:5d}  loss {rec['loss']:.4f}  aux {rec['aux']:.3f}  mi {rec['mi']:.3f}  "
        f"lr {lr_at(step, cfg):.2e}  {elapsed / 60:.1f} min",
        flush=True,
    )
    return rec


def save(model: Qwen3MoeForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out)


def main(argv: list[str] | None = None) -> None:
    apply_process_settings()  # before anything computes
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("resources/models/demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=28.0, help="safety cap on training wall time")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    args = ap.parse_args(argv)
    cfg = TrainConfig(seed=args.seed, steps=args.steps)
    assert set(cfg.weights) == set(SKILLS)
    train(cfg, args.out, args.minutes)


if __name__ == "__main__":
    main()
