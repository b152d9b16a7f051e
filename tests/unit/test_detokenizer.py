"""Incremental detokenization and stop strings against whole-sequence decoding."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scheduler_svc.engine.detokenizer import IncrementalDetokenizer, OutputText

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "paged attention stores keys and values in blocks of sixteen tokens",
    "serving large language models with a scheduler and executors",
] * 20
TEXTS = [
    "hello world",
    " the fox jumps\nover  the dog",
    "héllo wörld, ça va? naïve café",
    "emoji 😀 and 日本語 mixed with ascii 🚀🚀",
]


def _byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece_like_tokenizer() -> Tokenizer:
    """Llama-style: metaspace word pieces, byte fallback for unknown characters, leading space stripped."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for token in byte_tokens:  # ordinary (not special) tokens, as in Llama's vocabulary
        vocab[token] = len(vocab)
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"byte_level": _byte_level_tokenizer(), "sentencepiece_like": _sentencepiece_like_tokenizer()}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_whole_decode_and_never_emits_broken_text(name, text):
    tok = TOKENIZERS[name]
    prompt = tok.encode("the quick brown").ids
    output = tok.encode(" " + text).ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.append([t]) for t in output]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert "".join(deltas) == expected


def test_multibyte_character_is_held_back_until_complete():
    tok = TOKENIZERS["sentencepiece_like"]
    ids = tok.encode("a😀").ids
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert ids[-4:] == byte_ids  # the emoji falls back to its four bytes
    detok = IncrementalDetokenizer(tok, tok.encode("hi").ids)
    assert detok.append(ids[:-4]) == " a"
    assert [detok.append([b]) for b in byte_ids] == ["", "", "", "😀"]


def test_incomplete_character_at_the_end_is_flushed_as_replacement():
    tok = TOKENIZERS["sentencepiece_like"]
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("hi").ids)
    assert detok.append(byte_ids[:2]) == ""
    flushed = detok.flush()
    assert flushed and set(flushed) == {"\ufffd"}


def _stream(tok, text: str, stop: tuple[str, ...]):
    out = OutputText(IncrementalDetokenizer(tok, tok.encode("the").ids), stop=stop)
    deltas = []
    for t in tok.encode(" " + text).ids:
        delta = out.append([t])
        deltas.append(delta.text)
        if delta.stopped:
            return out, deltas, True
    deltas.append(out.finish())
    return out, deltas, False


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_string_cuts_the_text_and_is_never_emitted(name):
    tok = TOKENIZERS[name]
    out, deltas, stopped = _stream(tok, "the quick brown fox jumps over", stop=("fox j", "zzz"))
    assert stopped
    assert "".join(deltas) == " the quick brown " == out.text
    assert not any("f" in d for d in deltas)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_partial_stop_match_is_held_back_then_released(name):
    tok = TOKENIZERS[name]
    out, deltas, stopped = _stream(tok, "the quick brown fox", stop=("quick red",))
    assert not stopped
    assert "".join(deltas) == " the quick brown fox"
    # "quick" could have started the stop string: it was released only with a later token.
    index_of_quick = next(i for i, d in enumerate(deltas) if "quick" in d)
    assert " brown" in "".join(deltas[: index_of_quick + 1]) or "brown" in deltas[index_of_quick]


def test_stop_string_at_the_very_start_gives_empty_text():
    tok = TOKENIZERS["byte_level"]
    out, deltas, stopped = _stream(tok, "hello world", stop=(" hello",))
    assert stopped and "".join(deltas) == "" and out.text == ""


@pytest.mark.parametrize("prompt_text", ["Great job! 🎉👍", "ok 日😀", "🚀🚀", "x 😀😀😀"])
def test_prompt_ending_in_adjacent_byte_fallback_characters_gives_no_replacement_chars(prompt_text):
    """The last prompt tokens are bytes of two characters, cut mid-character at the window start:
    byte fallback decodes that whole run to U+FFFD, which is prompt text, never output."""
    tok = TOKENIZERS["sentencepiece_like"]
    prompt = tok.encode(prompt_text).ids
    output = tok.encode(" the quick brown fox").ids[1:]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.append([t]) for t in output] + [detok.flush()]
    assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert all("\ufffd" not in d for d in deltas)
