"""A conversation at the token level, through the model's own chat template.

Many templates render the start of a conversation differently depending on what follows:
SmolLM2 and Qwen 2.5 add a default system prompt only when none is given, Gemma 3 folds the
system prompt into the first user turn, Mistral writes it inside an [INST] block. So a new
agent holds only the *stable prefix* of its conversation (what every first turn renders
before its own words, the system prompt included, prefilled at creation), and its first turn
renders the whole conversation at once; the cache keeps whatever of it matches.

Later turns render only what new messages add: render(P + new) minus render(P), for a fixed
placeholder conversation P ending with the same role as the agent's last message (so a
template's alternation rule sees what the real conversation would), and tokenize that text
alone. The past is never re-tokenized, no BOS appears mid-sequence, and a generated reply is
closed with the template's own closing text. A template that refuses a conversation is an
INVALID_ARGUMENT carrying the template's own message.

Tools (inference_worker.tools) are rendered wherever the template puts them, in every render
of the conversation, the placeholder's too; like the system prompt they are part of what a
resent conversation must match.

What callers write is text, never control tokens: an added token's text (`<|im_start|>`,
Qwen's `<tool_call>`) in a message, a tool's definition, a call's arguments or a tool's
result is tokenized as the characters it spells, so no message can close its own turn and
open a system one, or plant a call. Only the template's own markup becomes those tokens; an
assistant's text keeps the model's own non-special ones (`<think>`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

from agentkv.errors import InvalidArgument
from agentkv.ids import show
from inference_worker.conversation import (
    ChatMessage,
    ChatState,
    chain,
    common_prefix,
    resume,
    start_digest,
)
from inference_worker.tools import ReplyCalls, ToolCall, ToolFormat, canonical_tools

ROLES = ("system", "user", "assistant", "tool")
_PING = {"role": "user", "content": "ping-q7Zx"}
_PONG = {"role": "assistant", "content": "pong-q7Zx"}
_CALL = ToolCall("call_q7Zx", "f_q7Zx", "{}").template()
_PLACEHOLDERS = {  # a conversation ending with each role
    "system": [{"role": "system", "content": "sys-q7Zx"}],
    "user": [_PING],
    "assistant": [_PING, _PONG],
    "tool": [
        _PING,
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "content": "pong-q7Zx", "tool_call_id": _CALL["id"]},
    ],
}
_PROBE = "q7Zx"
PROBE_SECONDS = 10.0  # a real template renders one message in milliseconds
PROBE_CHARS = 1 << 20
_PROBE_TOOLS = canonical_tools(json.dumps([{"type": "function", "function": {"name": "t_q7Zx"}}]))
_FIRST_WORDS = ("Alpha", "Bravo")  # two first user turns; what they share is stable
# An added token's text in what a caller wrote, as rendered: the template passes these
# private-use characters through (callers' own are dropped), and _encode spells the token's
# text there as text.
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
_ESCAPED = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")
_MARKERS = re.compile(f"[{_OPEN}{_CLOSE}]")


def chat_template_stuck() -> bool:
    """Whether a chat template's first render is still running past its time limit."""
    return any(t.name == "template-probe" and t.is_alive() for t in threading.enumerate())


class NotAppendOnly(InvalidArgument):
    """The template rewrites what came before when these messages are added."""


class ChatFormat:
    """Token-level conversations for one tokenizer (an mlx-lm TokenizerWrapper or HF one)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        specials, added = _added_texts(tokenizer)
        self._added = sorted(added)  # every added token's text, special or not
        self._index = {text: i for i, text in enumerate(self._added)}
        self._special = re.compile(_trie(specials) or "(?!)")  # what an assistant's text escapes
        self._control = re.compile(_trie(self._added) or "(?!)")  # what all else escapes
        self._newline = self._plain("\n")  # what _piece strips: "\n" before a piece
        asked = self._first_render()
        if _PING["content"] not in asked:
            raise InvalidArgument(  # a template rendering no message: every turn unheard
                f"the model's chat template leaves out what a user says (a user message "
                f"{_PING['content']!r} renders as {asked[:80]!r})"
            )
        self._closing = self._closing_text(asked)  # what closes a reply, e.g. "<|im_end|>\n"
        self.reply_closing = self._encode(self._closing) if self._closing else []
        ids = getattr(tokenizer, "eos_token_ids", None) or tokenizer.eos_token_id
        self.eos_ids = {ids} if isinstance(ids, int) else set(ids)
        self.tool_format = ToolFormat.of(tokenizer) if self._tools_stay_put() else None

    def _first_render(self) -> str:
        """A one-message conversation rendered, within PROBE_SECONDS and PROBE_CHARS: a
        template (a GGUF's, anyone's) that loops for hours or writes gigabytes stops the
        worker at its start in one line, not at a turn (its thread ends with the process)."""
        done: list[Any] = []

        def render() -> None:
            try:
                done.append(self._render([_PING], generation_prompt=True))
            except BaseException as exc:  # raised on this thread, below
                done.append(exc)

        thread = threading.Thread(target=render, name="template-probe", daemon=True)
        thread.start()
        thread.join(PROBE_SECONDS)
        if not done:
            raise InvalidArgument(
                "the model's chat template did not render a one-message conversation within "
                f"{PROBE_SECONDS:g} s"
            )
        if isinstance(done[0], BaseException):
            raise done[0]
        if len(done[0]) > PROBE_CHARS:
            raise InvalidArgument(
                f"the model's chat template renders a one-message conversation as "
                f"{len(done[0]):,} characters, past {PROBE_CHARS:,}"
            )
        return done[0]

    def start(self, system: str, tools: str = "") -> tuple[list[int], ChatState]:
        """A new conversation: its stable prefix (the tokens every first user turn renders
        before its own words), less the last token, whose spelling can depend on them."""
        self.check_tools(tools)
        head = [ChatMessage("system", system)] if system else []
        first = [
            self._encode(self._render(_dicts([*head, ChatMessage("user", w)]), True, tools))
            for w in _FIRST_WORDS
        ]
        shared = common_prefix(*first)
        state = ChatState(system, opened=False, digest=start_digest(system, tools), tools=tools)
        return first[0][: max(0, shared - 1)], state

    def count(self, messages: Sequence[ChatMessage], tools: str = "") -> int:
        """The tokens a whole conversation renders to as a new agent's first turn, ready
        for its reply (or, ending with the assistant's message, as it stands)."""
        self.check_tools(tools, messages)
        start = resume([], ChatState(), messages, tools)
        reply = not messages or messages[-1].role != "assistant"
        return len(self.extend(start.tokens, start.state, start.messages, reply)[0])

    def check_tools(self, tools: str, messages: Sequence[ChatMessage] = ()) -> None:
        """Refuses tools, tool calls and tool results for a model whose tool calls would not
        be understood, or whose template renders them where a turn cannot append them."""
        tooled = any(m.tool_calls or m.role == "tool" for m in messages)
        if (tools or tooled) and self.tool_format is None:
            raise InvalidArgument(
                "this model has no tool-call format mlx-lm knows (none is inferred from its "
                "chat template), or its template renders tools anew with each user message: "
                "tools, tool calls and tool results are refused (a worker started with "
                "--chat-template FILE uses a template that has one)"
            )

    def _tools_stay_put(self) -> bool:
        """Whether the template renders tools once, where a user message appended later
        does not render them again (Mistral v0.3 renders them before the last one)."""
        try:
            user = ChatMessage("user", "again-q7Zx")
            return "t_q7Zx" not in self._appended([user], True, "assistant", _PROBE_TOOLS)[1]
        except InvalidArgument:
            return False

    def reply_calls(
        self, tools: str, limit: int = 0, allowed: Sequence[str] = ()
    ) -> ReplyCalls | None:
        """What takes a reply's tool calls (up to `limit`, when not 0; of the `allowed`
        tools, when given) out of its text, for a conversation with tools."""
        if not tools or self.tool_format is None:
            return None
        opening = self._encode(self.tool_format.start)
        special = len(opening) == 1 and self.tool_format.start in self._index
        return ReplyCalls(
            self.tool_format,
            json.loads(tools),
            limit,
            frozenset(allowed),
            opening[0] if special else None,
        )

    def extend(
        self,
        context: Sequence[int],
        state: ChatState,
        messages: Sequence[ChatMessage],
        generation_prompt: bool,
    ) -> tuple[list[int], ChatState]:
        """The context after `messages` (and, if asked, the assistant's generation prompt)."""
        if not messages and not generation_prompt:
            return list(context), state  # nothing to add (an unopened agent stays so)
        last = messages[-1].role if messages else state.last_role
        digest = chain(state.digest, messages)
        said = ChatState(last_role=last, digest=digest, marks=state.marks, tools=state.tools)
        if not state.opened:
            head = [ChatMessage("system", state.system)] if state.system else []
            if not head and not messages:
                return list(context), state  # nothing to render yet
            text = self._render(_dicts([*head, *messages]), generation_prompt, state.tools)
            return self._encode(text), said
        close = self.close_reply(context) if state.reply_open else []
        added = self.append(messages, generation_prompt, state.last_role, state.tools)
        return [*context, *close, *added], said

    def append(
        self,
        messages: Sequence[ChatMessage],
        generation_prompt: bool,
        after: str = "assistant",
        tools: str = "",
    ) -> list[int]:
        """Token ids that `messages` add to a conversation whose last message is `after`'s:
        tokenized after the text the template writes before them, as a whole conversation's
        rendering tokenizes them (a SentencePiece tokenizer would begin them with a "▁"
        where that text is no special token, Mistral v0.1's " [/INST]"), where that text's
        own tokens stay as they are."""
        before, added = self._appended(messages, generation_prompt, after, tools)
        before = before[max(0, before.rfind(_PROBE)) :]  # from the placeholder's last words:
        head = self._encode(before)  # a turn costs its tail, not its tools' rendering
        whole = self._encode(before + added)
        return whole[len(head) :] if whole[: len(head)] == head else self._encode(added)

    def _appended(
        self, messages: Sequence[ChatMessage], generation_prompt: bool, after: str, tools: str
    ) -> tuple[str, str]:
        """The text before what `messages` add (a placeholder conversation's), and theirs."""
        placeholder = _PLACEHOLDERS.get(after, _PLACEHOLDERS["assistant"])
        before = self._render(placeholder, False, tools)
        full = self._render(placeholder + _dicts(messages), generation_prompt, tools)
        if not full.startswith(before):  # e.g. Qwen3 renders a last reply differently
            before = self._reply_end(full, placeholder[-1])
        if before is None:
            raise NotAppendOnly(
                "the model's chat template does not render this conversation append-only: "
                f"appending {', '.join(m.role for m in messages) or 'a generation prompt'} "
                f"after a {after} message rewrites what came before"
            )
        return before, full[len(before) :]

    def _reply_end(self, full: str, last: dict) -> str | None:
        """The text of `full` up to the end of the placeholder's last reply and its closing,
        for templates that render a conversation's last reply differently (Qwen3 gives it
        an empty think block) from one that more messages follow."""
        at = full.find(last["content"])
        end = at + len(last["content"])
        if last["role"] != "assistant" or at < 0 or not full.startswith(self._closing, end):
            return None
        return full[: end + len(self._closing)]

    def close_reply(self, context: Sequence[int]) -> list[int]:
        """What closes a generated reply (e.g. "<|end|>\\n"), less a closing token already
        generated as its end-of-sequence."""
        closing = self.reply_closing
        if context and closing and context[-1] == closing[0]:
            return closing[1:]
        return closing

    def _closing_text(self, asked: str) -> str:
        """What follows a reply, from `asked` (_PING rendered for a reply to follow)."""
        answered = self._render([_PING, {"role": "assistant", "content": _PROBE}], False)
        at = answered.find(_PROBE, len(asked) if answered.startswith(asked) else 0)
        return answered[at + len(_PROBE) :] if at >= 0 else ""

    def _render(self, messages: list[dict], generation_prompt: bool, tools: str = "") -> str:
        # What callers wrote is text, never markup: every added token's text in it is
        # escaped, but for the special ones only in an assistant's text (a model's own
        # <think> or <tool_call> stays as it wrote them).
        try:
            extra = {"tools": self._escaped(json.loads(tools), self._control)} if tools else {}
            messages = [self._escaped_message(m) for m in messages]
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
            )
        except RecursionError:
            raise InvalidArgument("the conversation or its tools nest too deeply") from None
        except Exception as exc:  # the template's own raise_exception, or a jinja error
            roles = ", ".join(m["role"] for m in messages)
            raise InvalidArgument(
                f"the model's chat template refuses this conversation ({roles}): "
                f"{str(exc).strip() or type(exc).__name__}"
            ) from exc

    def _encode(self, text: str) -> list[int]:
        if _OPEN not in text:
            return self._plain(text)
        ids: list[int] = []
        for i, part in enumerate(_ESCAPED.split(text)):  # markup, escaped, markup, ...
            if i % 2 and int(part) < len(self._added):
                ids += self._spelled(self._added[int(part)], bool(ids))
            elif part:
                ids += self._piece(part) if ids else self._plain(part)
        return ids

    def _escaped_message(self, message: dict) -> dict:
        """A message escaped: an assistant's text of the special tokens only."""
        own = message.get("role") == "assistant"
        return {
            k: self._escaped(v, self._special if own and k == "content" else self._control)
            for k, v in message.items()
        }

    def _escaped(self, value: Any, tokens: re.Pattern) -> Any:
        """`value` (a message, a tool's definition) with every text of `tokens` in its
        strings, keys too, escaped (_OPEN index _CLOSE) for _encode to spell."""
        if isinstance(value, str):
            if _MARKERS.search(value):
                value = _MARKERS.sub("", value)
            if not tokens.search(value):
                return value
            return tokens.sub(lambda m: f"{_OPEN}{self._index[m.group()]}{_CLOSE}", value)
        if isinstance(value, dict):
            return {self._escaped(k, tokens): self._escaped(v, tokens) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escaped(v, tokens) for v in value]
        return value

    def _spelled(self, text: str, within: bool) -> list[int]:
        """Tokens that spell `text`, an added token's, as text (`within` a text already
        begun): cut where no added token can match."""
        head, tail = text[:1], text[1:]
        first = self._piece(head) if within else self._plain(head)
        rest = self._spelled(tail, True) if self._control.search(tail) else self._piece(tail)
        return first + rest

    def _piece(self, text: str) -> list[int]:
        """`text` tokenized as it would be after other text: a tokenizer that marks the
        start of its input (SentencePiece's "▁") is given a newline first, then its tokens
        are dropped."""
        ids = self._plain("\n" + text) if text else []
        n = len(self._newline)
        return ids[n:] if n and ids[:n] == self._newline else self._plain(text)

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


def _added_texts(tokenizer: Any) -> tuple[set[str], set[str]]:
    """The texts of the tokenizer's special tokens, and of all its added tokens (those a
    text turns into one, special or not: Qwen's <tool_call> is not special)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {t.content for t in added.values() if t.content}
    return {t.content for t in added.values() if t.special and t.content}, texts


def _trie(words: Sequence[str]) -> str:
    """A regex matching any of `words`, the longest where several match, as a trie: one
    step per character, however many words (Gemma 3 has thousands of special tokens)."""
    root: dict = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    done: dict[int, str] = {}  # each node's pattern, children first: a word of thousands
    stack = [(root, False)]  # of characters is as many nodes deep, past Python's recursion
    while stack:
        node, ready = stack.pop()
        if not ready:
            stack += [(node, True), *((child, False) for ch, child in node.items() if ch)]
            continue
        branches = [re.escape(ch) + done[id(child)] for ch, child in sorted(node.items()) if ch]
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        done[id(node)] = "" if not branches else f"(?:{body})?" if "" in node else body
    return done[id(root)]


def _dicts(messages: Sequence[ChatMessage]) -> list[dict]:
    for m in messages:
        if m.role not in ROLES:
            raise InvalidArgument(f"message role {show(m.role)} is not one of {', '.join(ROLES)}")
        if (m.tool_calls and m.role != "assistant") or (m.tool_call_id and m.role != "tool"):
            raise InvalidArgument(
                f"a {m.role} message has tool calls or answers one: only an assistant's calls "
                "tools, and only a tool's answers"
            )
    return [m.template() for m in messages]
