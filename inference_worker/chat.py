"""Appending messages to a conversation at the token level, through the model's chat template.

The first turn renders the whole template (with its BOS). Later turns render only what new
messages add: render(P + new) minus render(P) for a fixed placeholder conversation P, then
tokenize that text with no special tokens added. The past is never re-tokenized, and no BOS
appears mid-sequence. A generated reply is closed with the template's own closing text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentkv.errors import InvalidArgument

ROLES = ("system", "user", "assistant")
_PLACEHOLDER = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
_PROBE = "q7Zx"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class ChatFormat:
    """Token-level appends for one tokenizer (an mlx-lm TokenizerWrapper or HF tokenizer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._placeholder = self._render(_PLACEHOLDER, generation_prompt=False)
        self.reply_closing = self._closing_tokens()
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])

    def first_turn(self, messages: Sequence[ChatMessage], generation_prompt: bool) -> list[int]:
        """Token ids of a new conversation, BOS included (once) as the template puts it."""
        text = self._render(_dicts(messages), generation_prompt) if messages else ""
        bos = getattr(self.tokenizer, "bos_token", None)
        if not text:
            return [self.tokenizer.bos_token_id] if bos else []
        return self._encode(text)

    def append(self, messages: Sequence[ChatMessage], generation_prompt: bool) -> list[int]:
        """Token ids that `messages` add to an existing conversation."""
        if not messages and not generation_prompt:
            return []
        full = self._render(_PLACEHOLDER + _dicts(messages), generation_prompt)
        if not full.startswith(self._placeholder):
            raise InvalidArgument("the chat template does not render conversations append-only")
        return self._encode(full[len(self._placeholder) :])

    def close_reply(self, context: Sequence[int]) -> list[int]:
        """What closes a generated reply (e.g. "<|end|>\\n"), less a closing token already
        generated as its end-of-sequence."""
        closing = self.reply_closing
        if context and closing and context[-1] == closing[0]:
            return closing[1:]
        return closing

    def _closing_tokens(self) -> list[int]:
        asked = self._render(_PLACEHOLDER[:1], generation_prompt=True)
        answered = self._render(
            [*_PLACEHOLDER[:1], {"role": "assistant", "content": _PROBE}], generation_prompt=False
        )
        head = asked + _PROBE
        if not answered.startswith(head):
            return []
        return self._encode(answered[len(head) :])

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _dicts(messages: Sequence[ChatMessage]) -> list[dict]:
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"message role {m.role!r} is not one of {', '.join(ROLES)}")
        if not m.content.strip():
            raise InvalidArgument(f"message {i} ({m.role}) is empty")
    return [{"role": m.role, "content": m.content} for m in messages]
