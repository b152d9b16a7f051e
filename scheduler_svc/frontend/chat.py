"""What the HTTP API reads of the model: its chat template and its tokenizer.

Chat requests are rendered and tokenized here, in the front-end process, and sent to the scheduler
as token ids: the scheduler process (whose CPU time per step is the serving bottleneck) does no
template work, and the prompt is tokenized without the tokenizer's own special tokens, as Hugging
Face's `apply_chat_template` does (the template writes BOS itself). The template is the one the
scheduler reports (GetModelInfo: the model folder's, scheduler_svc/wire/chat_template.py renders it)
unless `--chat-template FILE` overrides it. The tokenizer (the model folder's tokenizer.json) also
names the tokens of logprobs ("token_id:N" without one).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from scheduler_svc.wire.chat_template import ChatTemplate
from scheduler_svc.wire.errors import InvalidRequestError


class ModelText:
    """The chat template and the model folder's tokenizer, as the HTTP handlers use them."""

    def __init__(self, template: ChatTemplate, folder: str | None = None):
        tokenizer_file = pathlib.Path(folder) / "tokenizer.json" if folder else None
        self.tokenizer = (
            Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file and tokenizer_file.exists() else None
        )
        self.template = template
        self._token_text: dict[int, str] = {}
        self._byte_level: bool | None = None  # the tokenizer's pieces are byte-level BPE (found once)

    @classmethod
    def with_override(
        cls, reported: ChatTemplate, folder: str | None, template_file: str | None
    ) -> ModelText:
        """`template_file`'s template (with the reported special tokens) instead of the reported one."""
        if template_file:
            source = pathlib.Path(template_file).read_text()
            reported = ChatTemplate(source, reported.bos_token, reported.eos_token)
        return cls(reported, folder)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The chat's prompt token ids; raises InvalidRequestError("messages") when it cannot render."""
        if not self.template.source:
            raise InvalidRequestError(
                "messages", "this model has no chat template (give the server --chat-template FILE); "
                "use /v1/completions")
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this server has no tokenizer; use /v1/completions "
                                                  "with token ids")
        try:
            text = self.template.render(messages, add_generation_prompt)
        except ValueError as err:
            raise InvalidRequestError("messages", str(err)) from None
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def token_text(self, token_id: int) -> str:
        """A token as text (cached: at most one entry per vocabulary id)."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprobs `bytes`, from which a client rebuilds a character
        that several tokens split): a byte-level BPE piece read back through its byte alphabet, a
        byte-fallback piece <0xNN> as its byte, else the token's text (every byte token decoded
        alone read as U+FFFD, [239, 191, 189])."""
        text = self.token_text(token_id)
        if self.tokenizer is None:
            return text.encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return text.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        if self._byte_level is None:
            self._byte_level = _decodes_byte_level(self.tokenizer)
        if self._byte_level and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return text.encode()

    def token_label(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or where that is not the token's bytes (a part of a
        character: U+FFFD) "bytes:" and the bytes escaped, as OpenAI writes them, so that two such
        tokens never share a name (completions' top_logprobs is keyed by it)."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token_id)
        if raw == text.encode():
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _byte_alphabet() -> dict[str, int]:
    """The printable stand-in of each byte in a byte-level BPE vocabulary (GPT-2's scheme): the
    printable Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on,
    in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_alphabet()


def _decodes_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's decoder is (or holds) ByteLevel: its pieces are byte strings."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return any(isinstance(part, dict) and part.get("type") == "ByteLevel" for part in parts)
