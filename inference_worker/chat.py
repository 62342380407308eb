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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentkv.errors import InvalidArgument, MarkNotFound, TurnsFollow
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
_PROBE_TOOLS = canonical_tools(json.dumps([{"type": "function", "function": {"name": "t_q7Zx"}}]))
_FIRST_WORDS = ("Alpha", "Bravo")  # two first user turns; what they share is stable


class NotAppendOnly(InvalidArgument):
    """The template rewrites what came before when these messages are added."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's
    tool_call_id: str = ""  # a tool message's: the call it answers

    def words(self) -> str:
        """What identifies the message in a conversation's digest."""
        if not (self.tool_calls or self.tool_call_id):
            return f"{self.role}\0{self.content}"
        calls = "".join(f"\0{c.key()}" for c in self.tool_calls)
        content = self.content.strip() if self.tool_calls else self.content
        return f"{self.role}\0{content}\0{self.tool_call_id}{calls}"

    def template(self) -> dict:
        """The message as chat templates read it."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.template() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True, slots=True)
class Mark:
    """A point in an agent's conversation that a resent conversation can resume from: after
    the messages whose chain digest is `digest` (client/core.py's replies included, by the
    text the worker sent), at token `end`, the last message being `last_role`'s, and the first
    `cached` tokens in the cache (a reply's last token is not, until the next turn)."""

    digest: str
    end: int
    cached: int
    last_role: str
    reply_open: bool
    name: str = ""  # what its turn's caller named it (TurnRequest.mark_name), if anything
    calls: tuple[str, ...] = ()  # the ids of the tool calls its reply made, in order


MAX_MARKS = 64  # an agent keeps its last this many marks (one a turn): one metadata value


@dataclass(slots=True)
class ChatState:
    """Where an agent's conversation stands, besides its tokens."""

    system: str = ""  # its system prompt, kept until the first turn renders it whole
    opened: bool = True  # the first turn has rendered the conversation whole
    last_role: str = "assistant"  # of the last message in the context
    reply_open: bool = False  # the last tokens are a generated reply not yet closed
    digest: str = ""  # chain digest of every message so far, the system prompt first
    marks: tuple[Mark, ...] = ()  # where each turn ended, oldest first
    applied: str = ""  # request_id of the last turn or injection taken (a retry of it)
    tools: str = ""  # the conversation's tools (tools.canonical_tools), rendered in each part

    def marked(
        self, end: int, cached: int, name: str = "", calls: tuple[str, ...] = ()
    ) -> ChatState:
        """This state with a mark here, at token `end` (`cached` of them in the cache),
        after a reply that made `calls`."""
        mark = Mark(self.digest, end, cached, self.last_role, self.reply_open, name, calls)
        kept = tuple(m for m in self.marks if m.end < end)[-(MAX_MARKS - 1) :]
        return replace(self, marks=(*kept, mark))


def chain(digest: str, messages: Sequence[ChatMessage]) -> str:
    """The digest of a conversation `messages` longer than the one whose digest is `digest`."""
    for m in messages:
        h = hashlib.blake2b(f"{digest}\0{m.words()}".encode(), digest_size=12)
        digest = h.hexdigest()
    return digest


def tools_digest(tools: str) -> str:
    """Where a conversation's digest starts: its tools' (none: "")."""
    return chain("", [ChatMessage("tools", tools)]) if tools else ""


def start_digest(system: str, tools: str = "") -> str:
    seed = tools_digest(tools)
    return chain(seed, [ChatMessage("system", system)]) if system else seed


@dataclass(slots=True)
class Resumed:
    """Where a resent conversation picks up: the context and state to extend, the messages
    still to render, and how many cached tokens the turn may keep (`cached`, or None: those
    of a new agent's stable prefix)."""

    tokens: list[int]
    state: ChatState
    messages: list[ChatMessage]
    cached: int | None
    # Started over: the stable prefix's tokens, which the cache keeps whole or the turn
    # prefills as a turn of their own, as a new agent's are made (context._resumed).
    prefix: int = 0


def resume(
    tokens: Sequence[int], state: ChatState, messages: Sequence[ChatMessage], tools: str = ""
) -> Resumed:
    """Where a whole conversation, resent (its system prompt first, if any) with its `tools`,
    picks up this agent's: its tokens and state at the latest mark whose messages begin
    `messages`, and the messages after them. Without one (the conversation was edited before
    any mark, or has another system prompt or tools), it starts over, rendered whole as a
    new agent's first turn.
    The turn keeps only the cache a fresh agent told this conversation turn by turn would
    hold there, so that it answers exactly as that agent does: Q4 KV of tokens from an
    earlier turn is not bit for bit what a turn computes for its own."""
    at: dict[str, int] = {}
    digest = tools_digest(tools)
    for i, message in enumerate(messages):
        digest = chain(digest, [message])
        at[digest] = i + 1
    for n, mark in enumerate(reversed(state.marks)):
        i = at.get(mark.digest)
        if i is not None and mark.end <= len(tokens):
            return _resumed_at(tokens, state, n, tools, messages[i:])
    system = messages[0].content if messages and messages[0].role == "system" else ""
    rest = list(messages[1:]) if messages and messages[0].role == "system" else list(messages)
    state = ChatState(system, opened=False, digest=start_digest(system, tools), tools=tools)
    return Resumed([], state, rest, None)


def continued(
    tokens: Sequence[int],
    state: ChatState,
    key: str,
    messages: Sequence[ChatMessage],
    last_only: bool = False,
    agent_id: str = "",
) -> Resumed:
    """Where `messages` pick up this agent's conversation when they follow its mark `key`
    (a turn's Usage.mark, or the name its turn gave it), not its end: its tokens and state
    there (the turns after it are dropped, as an edited resent conversation drops them).
    MarkNotFound when the agent keeps no such mark; TurnsFollow, with `last_only`, when
    turns follow it."""
    for n, mark in enumerate(reversed(state.marks)):
        if key not in (mark.digest, mark.name or None) or mark.end > len(tokens):
            continue
        if n and last_only:
            raise TurnsFollow(
                f"{n} turn(s) of agent {agent_id!r} follow the point {key!r}: continuing "
                "from it would drop them (fork the agent to branch there)"
            )
        return _resumed_at(tokens, state, n, state.tools, _answering(mark, messages))
    raise MarkNotFound(
        f"agent {agent_id!r} has no point {key!r} in its conversation: a later turn went "
        f"on from before it, or it is older than the agent's last {MAX_MARKS} turns"
    )


def _answering(mark: Mark, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The messages, their opening tool results put in the order of the calls the reply at
    `mark` made (templates pair results with calls by place); INVALID_ARGUMENT for results
    of other calls, or calls left unanswered. A mark that kept no calls takes them as given."""
    if not mark.calls:
        return list(messages)
    n = next((i for i, m in enumerate(messages) if m.role != "tool"), len(messages))
    answered = [m.tool_call_id for m in messages[:n]]
    if sorted(answered) != sorted(mark.calls):
        raise InvalidArgument(
            f"the reply at that point made the tool calls {list(mark.calls)}: tool results "
            f"answer each once, before any other message (these answer {answered[:16]})"
        )
    place = {call_id: i for i, call_id in enumerate(mark.calls)}
    return sorted(messages[:n], key=lambda m: place[m.tool_call_id]) + list(messages[n:])


def _resumed_at(
    tokens: Sequence[int], state: ChatState, n: int, tools: str, messages: Sequence[ChatMessage]
) -> Resumed:
    """The agent's conversation at its `n`th mark from the last (0: the last), with the
    `messages` that follow it there still to render."""
    kept = state.marks[: len(state.marks) - n]
    mark = kept[-1]
    resumed = ChatState(
        last_role=mark.last_role,
        reply_open=mark.reply_open,
        digest=mark.digest,
        marks=kept,
        tools=tools,
    )
    return Resumed(list(tokens[: mark.end]), resumed, list(messages), mark.cached)


class ChatFormat:
    """Token-level conversations for one tokenizer (an mlx-lm TokenizerWrapper or HF one)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._closing = self._closing_text()  # what closes a reply, e.g. "<|im_end|>\n"
        self.reply_closing = self._encode(self._closing) if self._closing else []
        ids = getattr(tokenizer, "eos_token_ids", None) or tokenizer.eos_token_id
        self.eos_ids = {ids} if isinstance(ids, int) else set(ids)
        self.tool_format = ToolFormat.of(tokenizer) if self._tools_stay_put() else None

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
            return "t_q7Zx" not in self._appended([user], True, "assistant", _PROBE_TOOLS)
        except InvalidArgument:
            return False

    def reply_calls(
        self, tools: str, limit: int = 0, allowed: Sequence[str] = ()
    ) -> ReplyCalls | None:
        """What takes a reply's tool calls (up to `limit`, when not 0; of the `allowed`
        tools, when given) out of its text, for a conversation with tools."""
        if not tools or self.tool_format is None:
            return None
        return ReplyCalls(self.tool_format, json.loads(tools), limit, frozenset(allowed))

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
        """Token ids that `messages` add to a conversation whose last message is `after`'s."""
        return self._encode(self._appended(messages, generation_prompt, after, tools))

    def _appended(
        self, messages: Sequence[ChatMessage], generation_prompt: bool, after: str, tools: str
    ) -> str:
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
        return full[len(before) :]

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

    def _closing_text(self) -> str:
        asked = self._render([_PING], generation_prompt=True)
        answered = self._render([_PING, {"role": "assistant", "content": _PROBE}], False)
        at = answered.find(_PROBE, len(asked) if answered.startswith(asked) else 0)
        return answered[at + len(_PROBE) :] if at >= 0 else ""

    def _render(self, messages: list[dict], generation_prompt: bool, tools: str = "") -> str:
        extra = {"tools": json.loads(tools)} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
            )
        except Exception as exc:  # the template's own raise_exception, or a jinja error
            roles = ", ".join(m["role"] for m in messages)
            raise InvalidArgument(
                f"the model's chat template refuses this conversation ({roles}): "
                f"{str(exc).strip() or type(exc).__name__}"
            ) from exc

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_said(messages: Sequence[ChatMessage]) -> None:
    """Refuses an empty message among those a turn or injection adds to a context (an empty
    `say` is a caller's slip). A resent whole conversation may hold one, as OpenAI's API
    allows: an empty reply, cut at once by a stop string, comes back in the history."""
    for i, m in enumerate(messages):
        if not m.content.strip() and not m.tool_calls and m.role != "tool":
            raise InvalidArgument(f"message {i} ({m.role}) is empty")


def _dicts(messages: Sequence[ChatMessage]) -> list[dict]:
    for m in messages:
        if m.role not in ROLES:
            raise InvalidArgument(f"message role {m.role!r} is not one of {', '.join(ROLES)}")
        if (m.tool_calls and m.role != "assistant") or (m.tool_call_id and m.role != "tool"):
            raise InvalidArgument(
                f"a {m.role} message has tool calls or answers one: only an assistant's calls "
                "tools, and only a tool's answers"
            )
    return [m.template() for m in messages]
