"""A chat's history against the model's context: which turns the model sees.

One place for every client (the window through the worker, `moescope chat` directly), since the
prompt's length in tokens needs the model's tokenizer and chat template. With "drop-oldest" the
oldest whole turns (a user message and the replies after it) are left out until the prompt fits with
room for the reply; the system prompt and the newest turn always stay. With "stop" nothing is left
out and a prompt over the context is refused. A newest turn that cannot fit alone is refused either
way, naming its length, before anything is generated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.errors import ContextFullError, MoEScopeError, PromptTooLongError
from engine.protocol import CONTEXT_OVERFLOW

REPLY_SHARE = 4  # room kept for the reply: max_new_tokens, at most a quarter of the context

EncodeFn = Callable[[list[dict]], list[int]]


@dataclass
class FittedPrompt:
    ids: list[int]  # the prompt the model gets
    first_message: int  # index in the messages of the first one after the system prompt that it sees
    dropped_messages: int  # left out before that one


def reply_room(context_length: int, max_new_tokens: int) -> int:
    """Tokens kept free for the reply when older turns are dropped. Capped, so that a large max tokens
    setting (the window's default is 512, the demo's whole context) does not empty the history."""
    return max(1, min(max_new_tokens, context_length // REPLY_SHARE))


def fit_chat(encode: EncodeFn, messages: Sequence[dict], context_length: int, max_new_tokens: int,
             overflow: str) -> FittedPrompt:
    """The prompt for `messages` under the `overflow` policy, or PromptTooLongError saying why not."""
    if overflow not in CONTEXT_OVERFLOW:
        raise MoEScopeError(f"context overflow must be one of {', '.join(CONTEXT_OVERFLOW)}, got {overflow!r}")
    messages = list(messages)
    system = _leading_system(messages)
    starts = _turn_starts(messages, system)
    ids = encode(messages)
    if overflow == "stop" or len(ids) + reply_room(context_length, max_new_tokens) <= context_length:
        if len(ids) < context_length:
            return FittedPrompt(ids, system, 0)
        if len(starts) > 1:  # the newest turn alone may fit: say which it is, the history or the message
            _refuse_if_alone_too_long(encode, messages, system, starts[-1], context_length)
            raise ContextFullError(
                f"the conversation is {len(ids):,} tokens but this model's context is {context_length:,} tokens; "
                "drop its oldest turns or start a new one")
        raise _too_long(len(ids), context_length)
    return _drop_oldest(encode, messages, system, starts, context_length, reply_room(context_length, max_new_tokens))


def _drop_oldest(encode: EncodeFn, messages: list[dict], system: int, starts: list[int], context_length: int,
                 room: int) -> FittedPrompt:
    """Leave out the fewest oldest turns so the prompt plus `room` fits (a binary search over the turns:
    the prompt only shortens as turns go). The newest turn alone need not leave the whole room."""
    def prompt_from(turn: int) -> list[int]:
        return encode(messages[:system] + messages[starts[turn]:])

    low, high = 1, len(starts) - 1  # the fewest turns to drop: at least one (all of them did not fit)
    best: tuple[int, list[int]] | None = None
    while low <= high:
        middle = (low + high) // 2
        ids = prompt_from(middle)
        if len(ids) + room <= context_length:
            best, high = (middle, ids), middle - 1
        else:
            low = middle + 1
    if best is None:  # only the newest turn is left
        best = (len(starts) - 1, prompt_from(len(starts) - 1))
        if len(best[1]) >= context_length:
            raise _too_long(len(best[1]), context_length)
    first = starts[best[0]]
    return FittedPrompt(best[1], first, first - system)


def _leading_system(messages: list[dict]) -> int:
    """How many messages at the start are system messages (always kept)."""
    count = 0
    while count < len(messages) - 1 and messages[count].get("role") == "system":
        count += 1
    return count


def _turn_starts(messages: list[dict], system: int) -> list[int]:
    """Where each turn begins: at each user message after the system prompt (what comes before the first
    one belongs to the first turn)."""
    starts = [i for i in range(system, len(messages)) if messages[i].get("role") == "user"]
    if not starts or starts[0] != system:
        starts.insert(0, system)
    return starts


def _refuse_if_alone_too_long(encode: EncodeFn, messages: list[dict], system: int, newest: int,
                              context_length: int) -> None:
    alone = encode(messages[:system] + messages[newest:])
    if len(alone) >= context_length:
        raise _too_long(len(alone), context_length)


def _too_long(tokens: int, context_length: int) -> PromptTooLongError:
    return PromptTooLongError(f"this message is {tokens:,} tokens; the model's context is {context_length:,} tokens "
                              "— shorten it")
