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
