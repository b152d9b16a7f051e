"""Incremental detokenization and stop strings, per output sequence.

Decoding one token at a time is wrong for most tokenizers: a SentencePiece word piece drops its
leading space when decoded alone, and a byte-fallback or byte-level token may carry only part of a
UTF-8 character. `IncrementalDetokenizer` therefore decodes a short window that starts a few tokens
before the new ones and emits only the text past what that window's prefix already produced
(the "prefix / read offset" scheme), and holds text back while it ends in U+FFFD, the mark of an
incomplete byte sequence, until a later token completes it.

`OutputText` adds stop strings on top: the text is cut before the first stop string, which is
never emitted; text that could still become the start of a stop string is held back until the
next tokens show it is not one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.wire.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenIdsOnly:
    """The tokenizer of a model folder without tokenizer.json (e.g. a benchmark shape with dummy
    weights): prompts must be token ids (a text prompt is INVALID_ARGUMENT) and outputs carry token
    ids with empty text."""

    def encode(self, text: str):
        raise InvalidRequestError("prompt", "this server has no tokenizer; send token_ids")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text without ever emitting a broken character."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The last prompt tokens give the first output token its context (e.g. its leading space).
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def append(self, token_ids: list[int]) -> str:
        """Adds output tokens; returns the text that became complete (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD); call once at the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        start = len(prefix_text)
        if prefix_text.endswith(REPLACEMENT_CHAR):
            # A prefix ending in an incomplete character (a prompt cut mid-character) is completed by
            # the new tokens: emit the completed character too. The U+FFFD the new tokens leave as
            # they were is the prefix's own text (a window starting mid-character can decode to
            # nothing else: byte fallback turns a whole invalid byte run into U+FFFD), never output.
            start = len(prefix_text.rstrip(REPLACEMENT_CHAR))
            end = min(len(prefix_text), len(full_text))
            while start < end and full_text[start] == REPLACEMENT_CHAR:
                start += 1
        if len(full_text) <= start and not final:
            return ""  # nothing visible yet (e.g. a skipped special token)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[start:]


@dataclass(slots=True)
class TextDelta:
    text: str
    stopped: bool = False  # a stop string was found; the sequence must finish now


@dataclass(slots=True)
class OutputText:
    """The text of one output sequence, with stop strings applied."""

    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...] = ()
    text: str = ""  # everything decoded so far, cut before a stop string once one is found
    num_emitted_chars: int = 0
    stopped: bool = False
    _max_stop_len: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def append(self, token_ids: list[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", stopped=True)
        old_len = len(self.text)
        self.text += self.detokenizer.append(token_ids)
        if self.stop and self._cut_at_stop(search_from=max(0, old_len - self._max_stop_len + 1)):
            return TextDelta(self._take(len(self.text)), stopped=True)
        return TextDelta(self._take(len(self.text) - self._held_back()))

    def finish(self) -> str:
        """The rest of the text once the sequence is finished (held-back text included)."""
        if not self.stopped:
            old_len = len(self.text)
            self.text += self.detokenizer.flush()
            if self.stop:
                self._cut_at_stop(search_from=max(0, old_len - self._max_stop_len + 1))
        return self._take(len(self.text))

    def _cut_at_stop(self, search_from: int) -> bool:
        found = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string. Only
        tails starting at an occurrence of a stop string's first character are tried, so a step
        costs about one `find` per stop string, not one comparison per tail length."""
        n = min(self._max_stop_len - 1, len(self.text))
        if n <= 0:
            return 0
        tail = self.text[-n:]
        best = 0
        for s in self.stop:
            i = tail.find(s[0], max(0, n - len(s) + 1))
            while 0 <= i < n - best:
                if s.startswith(tail[i:]):
                    best = n - i
                    break
                i = tail.find(s[0], i + 1)
        return best

    def _take(self, end: int) -> str:
        end = max(end, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta


class StopStringMatcher:
    """Whether a beam candidate's output text holds a stop string (beam search ends that beam there,
    like transformers' StopStringCriteria; sched/beam_search.py calls it on the top candidates).

    A live beam's text never holds one (it would have ended), so a candidate holds one exactly when
    its last token completes it. Only the tail is decoded: the last `window` tokens, enough for the
    longest stop string even in byte-fallback tokens; while the output is shorter than that, the
    prompt's last tokens come first (a SentencePiece word keeps its leading space), and a match must
    end past the prompt's text (one across the boundary counts, as in transformers)."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stop = stop
        self._window = 4 * max(len(s) for s in stop) + PROMPT_CONTEXT_TOKENS
        self._context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._context_chars = len(tokenizer.decode(self._context).rstrip(REPLACEMENT_CHAR))

    def __call__(self, output_token_ids: list[int]) -> bool:
        if len(output_token_ids) >= self._window:
            text, skip = self._tokenizer.decode(output_token_ids[-self._window :]), 0
        else:
            text, skip = self._tokenizer.decode(self._context + output_token_ids), self._context_chars
        return any(text.find(s, max(0, skip - len(s) + 1)) >= 0 for s in self._stop)
