"""A reply's text, decoded a window of tokens at a time (engine.decode.reply): the same text as the
whole reply decoded at once, streamed deltas that add up to it, and stop strings found where they
start, with the tokenizers MoEScope meets: the demo model's, byte-level BPE (Qwen, Llama 3, gpt-oss)
and a SentencePiece-style one whose tokens carry their leading space (Mixtral, Llama 2)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.decode.reply import Reply
from resources import DEMO_MODEL_DIR

TEXT = ("Grüße aus Köln! naïve café, 東京タワー and 🦜🦜 parrots. Ünïcödé spans tokens; "
        "it's 3.14 - don't split words like elephant, élan or 🙂.\n  Two spaces, then\ttabs.")


def _trained(model, pre_tokenizer, decoder, trainer) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator([TEXT] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


@pytest.fixture(params=["demo", "byte-level-bpe", "sentencepiece-style"])
def tokenizer(request):
    if request.param == "demo":
        return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    if request.param == "byte-level-bpe":
        return _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                        trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _trained(models.BPE(byte_fallback=True), pre_tokenizers.Metaspace(), decoders.Sequence(
        [decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()]),
        trainers.BpeTrainer(vocab_size=200, special_tokens=["</s>"]
                            + [f"<0x{b:02X}>" for b in range(256)]))


def reply_of(tokenizer, ids: list[int], stop: list[str] = ()) -> tuple[Reply, list[str]]:
    deltas: list[str] = []
    reply = Reply(tokenizer, set(), list(stop), len(ids) + 1, deltas.append, None, None)
    for token in ids:
        if not reply.take(token):
            break
    return reply, deltas


def test_the_text_a_window_at_a_time_is_the_whole_reply_decoded(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    reply, deltas = reply_of(tokenizer, ids)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert reply.text == whole and "".join(deltas) == whole
    assert all(delta and "\ufffd" not in delta for delta in deltas)  # no half characters streamed
    assert len(deltas) > len(ids) // 2  # it streams as it goes


@pytest.mark.parametrize("stop", ["élan", "🦜 p", "Köln! na", "tabs."])
def test_a_stop_string_over_several_tokens_ends_the_reply_where_it_starts(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    reply, deltas = reply_of(tokenizer, ids, [stop])
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert reply.finish == "stop"
    assert reply.text == whole[:whole.index(stop)]
    assert "".join(deltas).startswith(reply.text)  # what streamed before the stop string appeared
