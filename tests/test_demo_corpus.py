"""Fast checks of the demo corpus and tokenizer (no training, no model)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re

import pytest

from engine.demo.corpus import (
    CAPITALS,
    CHAT_INTENTS,
    CONVERSIONS,
    EXAMPLES,
    SKILLS,
    WORD_SKILLS,
    WORDS,
    Example,
    heldout,
    is_heldout,
    make_examples,
    training_mix,
)
from engine.demo.tokenizer import IM_END, build_tokenizer

N = 300


def expected_answer(ex: Example) -> str:
    """Recompute the answer from the question text alone."""
    q = ex.user
    nums = [int(v) for v in re.findall(r"\d+", q)]
    quoted = re.findall(r"'([a-z]+)'", q)
    if ex.skill == "add":
        return str(nums[0] + nums[1])
    if ex.skill == "subtract":
        return str(nums[0] - nums[1])
    if ex.skill == "multiply":
        return str(nums[0] * nums[1])
    if ex.skill == "count_letters":
        (word,) = quoted
        return str(len(word))
    if ex.skill == "reverse":
        return quoted[0][::-1]
    if ex.skill == "spell":
        return "-".join(quoted[0])
    if ex.skill == "convert":
        for target, source, factor, _ in CONVERSIONS:
            if re.search(rf"\b{target}\b", q) and re.search(rf"\b{source[:-1]}s?\b", q):
                return str(nums[0] * factor)
        raise AssertionError(f"unknown conversion: {q}")
    if ex.skill == "compare":
        return str(max(nums) if "larger" in q else min(nums))
    if ex.skill == "facts":
        (country,) = [c for c in CAPITALS if re.search(rf"\b{c}\b", q)]
        return CAPITALS[country]
    if ex.skill == "chat":
        norm = q.rstrip("?!.").lower()
        (reply,) = {r for phrasings, r in CHAT_INTENTS.values() if norm in {p.lower() for p in phrasings}}
        return reply
    raise AssertionError(f"unknown skill {ex.skill}")


@pytest.mark.parametrize("skill", sorted(SKILLS))
def test_deterministic_for_seed(skill: str) -> None:
    assert make_examples(skill, 50, seed=3) == make_examples(skill, 50, seed=3)
    assert heldout(skill, 20, seed=3) == heldout(skill, 20, seed=3)
    assert make_examples(skill, 50, seed=3) != make_examples(skill, 50, seed=4)


def test_training_mix_deterministic() -> None:
    w = {s: 1.0 for s in SKILLS}
    mix = training_mix(w, 500, seed=1)
    assert mix == training_mix(w, 500, seed=1)
    assert {e.skill for e in mix} == set(SKILLS)


@pytest.mark.parametrize("skill", sorted(SKILLS))
def test_heldout_disjoint_from_training(skill: str) -> None:
    train = make_examples(skill, 2000, seed=0)
    test = heldout(skill, 200, seed=0)
    assert len(test) >= 30, "too few held-out questions to evaluate"
    assert len({e.user for e in test}) == len(test), "held-out questions must be distinct"
    assert not {e.user for e in train} & {e.user for e in test}
    assert all(is_heldout(e.user) for e in test) and not any(is_heldout(e.user) for e in train)
    # Other seeds draw from the same split, so no seed leaks held-out text into training.
    assert not {e.user for e in make_examples(skill, 500, seed=7)} & {e.user for e in test}


@pytest.mark.parametrize("skill", sorted(SKILLS))
def test_answers_are_correct(skill: str) -> None:
    for ex in make_examples(skill, N, seed=0) + heldout(skill, 100, seed=0):
        assert ex.skill == skill
        assert ex.assistant == ex.assistant.strip() and ex.assistant
        assert ex.assistant == expected_answer(ex), ex


def phrasing(question: str) -> str:
    """A question with its numbers, quoted words and countries left out: the corpus template it came from."""
    shape = re.sub(r"'[a-z]+'", "'W'", re.sub(r"\d+", "N", question))
    return re.sub(r"\b(" + "|".join(sorted(CAPITALS, key=len, reverse=True)) + r")\b", "C", shape)


@pytest.mark.parametrize("skill", sorted(SKILLS))
def test_each_example_prompt_is_a_trained_phrasing_with_the_right_answer(skill: str) -> None:
    # the window offers these on an empty chat with the demo: they must be asked as the model learned
    example = EXAMPLES[skill]
    assert example.skill == skill and example.assistant == expected_answer(example)
    assert phrasing(example.user) in {phrasing(e.user) for e in make_examples(skill, 2000, seed=0)}


def test_word_skills_train_on_pseudo_words_but_hold_out_listed_words() -> None:
    for skill in WORD_SKILLS:
        train_words = {re.findall(r"'([a-z]+)'", e.user)[-1] for e in make_examples(skill, 400, seed=0)}
        test_words = {re.findall(r"'([a-z]+)'", e.user)[-1] for e in heldout(skill, 100, seed=0)}
        assert test_words <= set(WORDS)
        assert train_words & set(WORDS) and train_words - set(WORDS)


def test_tokenizer_round_trips_corpus() -> None:
    tok = build_tokenizer()
    texts = [t for s in SKILLS for e in make_examples(s, 40, seed=0) for t in (e.user, e.assistant)]
    texts += ["naïve café 😀 — ok", "tabs\tand\nnewlines"]  # any input is byte-encodable
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id is None or tok.unk_token_id not in ids
        assert tok.decode(ids) == text


def test_chat_template_ends_assistant_turn_with_eos() -> None:
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}]
    ids = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
    answer = tok.encode("42", add_special_tokens=False)
    at = next(
        i for i in range(len(ids)) if ids[i : i + len(answer)] == answer and ids[i + len(answer)] == tok.eos_token_id
    )
    assert ids[at + len(answer)] == tok.eos_token_id
    assert tok.eos_token == IM_END
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False).startswith(prompt)


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path) -> None:
    from transformers import AutoTokenizer

    from engine.demo.tokenizer import save_tokenizer

    save_tokenizer(build_tokenizer(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "Spell 'cat'."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nSpell 'cat'.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
