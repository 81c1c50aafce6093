"""A chat that never gets stuck: a history longer than the model's context keeps answering (the oldest
turns left out of what the model sees, nothing deleted), a message too long alone is refused before
anything is generated, naming its length, and "stop" refuses with one clear message instead.

The fitting itself against the demo model's tokenizer, then the window (a real engine worker),
`moescope chat` (a subprocess reading stdin) and `moescope serve` (which never trims) on the demo
model, whose context is 512 tokens."""

from __future__ import annotations

import pytest

from engine.decode.context_window import fit_chat, reply_room
from engine.errors import PromptTooLongError

CONTEXT = 512
PAD = "Tell me more about the mixture of experts, please. "  # long-ish turns reach 3x the context quickly


@pytest.fixture(scope="module")
def encode():
    from transformers import AutoTokenizer

    from resources import DEMO_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)

    def encode(messages: list[dict]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    return encode


def history(turns: int, system: str = "Be brief.") -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    for i in range(turns):
        messages += [{"role": "user", "content": f"{i}: {PAD * 2}"}, {"role": "assistant", "content": f"reply {i}"}]
    return messages + [{"role": "user", "content": "Hello!"}]


# ----------------------------------------------------------------- the fitting (tokenizer only)
def test_a_history_that_fits_is_sent_whole(encode):
    messages = history(1)
    fitted = fit_chat(encode, messages, CONTEXT, 64, "drop-oldest")
    assert fitted.ids == encode(messages) and (fitted.first_message, fitted.dropped_messages) == (1, 0)


def test_drop_oldest_leaves_out_whole_turns_and_keeps_room_for_the_reply(encode):
    messages = history(14)
    assert len(encode(messages)) > 3 * CONTEXT
    fitted = fit_chat(encode, messages, CONTEXT, 512, "drop-oldest")
    kept = messages[:1] + messages[fitted.first_message:]
    assert fitted.ids == encode(kept)  # the system prompt and the newest turns, whole
    assert messages[fitted.first_message]["role"] == "user" and kept[-1]["content"] == "Hello!"
    assert fitted.dropped_messages == fitted.first_message - 1 > 0
    room = reply_room(CONTEXT, 512)
    assert room == CONTEXT // 4 and len(fitted.ids) + room <= CONTEXT
    one_more = messages[:1] + messages[fitted.first_message - 2:]  # the fewest dropped: one more turn overflows
    assert len(encode(one_more)) + room > CONTEXT


def test_a_message_too_long_alone_is_refused_with_its_length(encode):
    messages = history(3)
    messages[-1]["content"] = PAD * 12
    alone = len(encode(messages[:1] + messages[-1:]))
    for overflow in ("drop-oldest", "stop"):
        with pytest.raises(PromptTooLongError) as refused:
            fit_chat(encode, messages, CONTEXT, 64, overflow)
        assert str(refused.value) == f"this message is {alone:,} tokens; the model's context is 512 tokens — shorten it"


def test_stop_refuses_the_whole_conversation_in_one_clear_message(encode):
    messages = history(14)
    with pytest.raises(PromptTooLongError) as refused:
        fit_chat(encode, messages, CONTEXT, 64, "stop")
    assert str(refused.value) == (f"the conversation is {len(encode(messages)):,} tokens but this model's context "
                                  "is 512 tokens; drop its oldest turns or start a new one")
    short = history(1)
    assert fit_chat(encode, short, CONTEXT, 64, "stop").ids == encode(short)  # what fits goes as it is
