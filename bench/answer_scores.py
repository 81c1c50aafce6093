"""Teacher-forced scores of the demo model's held-out answers: perplexity, and the KL divergence
and top-token agreement of each next-token distribution against a reference run of the same chats.

Every run reads the same token ids (the held-out question and its reference answer from
`engine.demo.corpus`), so two runs score the same positions whatever either would have generated.
Only the answer tokens are scored: the demo model is trained on answers only, so its predictions
of the user's words are meaningless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.demo.corpus import heldout


@dataclass(frozen=True)
class HeldoutChat:
    skill: str
    ids: list[int]  # the question through the assistant's end-of-turn token
    start: int  # index of the first answer token; every token from here to the end is scored


@dataclass(frozen=True)
class AnswerScores:
    perplexity: float  # exp(mean NLL) of the reference answers' tokens
    kl_mean: float  # mean over answer positions of KL(reference || this run), nats
    same_top_token: float  # share of answer positions where both runs' most likely next token agree
    positions: int


def heldout_chats(tokenizer, skills: Sequence[str], n_per_skill: int) -> list[HeldoutChat]:
    chats = []
    for skill in skills:
        for ex in heldout(skill, n_per_skill):
            question = tokenizer.apply_chat_template([{"role": "user", "content": ex.user}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": ex.user}, {"role": "assistant", "content": ex.assistant}],
                tokenize=True, return_dict=False)
            # the answer through <|im_end|>, not the newline the template puts after it
            chats.append(HeldoutChat(skill, list(chat[:-1]), len(question)))
    return chats


@torch.inference_mode()
def answer_logprobs(runtime, chats: Sequence[HeldoutChat]) -> list[torch.Tensor]:
    """Per chat, [answer tokens, vocab] float64 log-probabilities of each answer token's position,
    through the engine (its cache, store, policy, weight formats and the path a prompt takes, with
    its opt-in lossy modes), one chat per forward."""
    out = []
    for chat in chats:
        logits = runtime.prompt_logits(chat.ids)
        out.append(torch.log_softmax(logits[chat.start - 1 : -1].double().cpu(), dim=-1))
    return out


def compare(chats: Sequence[HeldoutChat], reference: Sequence[torch.Tensor],
            scored: Sequence[torch.Tensor]) -> AnswerScores:
    nll = kl = same = 0.0
    positions = 0
    for chat, ref, logp in zip(chats, reference, scored, strict=True):
        targets = torch.tensor(chat.ids[chat.start :])
        nll -= float(logp.gather(1, targets[:, None]).sum())
        kl += float((ref.exp() * (ref - logp)).sum())
        same += float((ref.argmax(-1) == logp.argmax(-1)).sum())
        positions += len(targets)
    return AnswerScores(math.exp(nll / positions), kl / positions, same / positions, positions)
