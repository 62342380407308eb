"""An agent's metadata in its manifest: the caller's entries, and the worker's own (keys
that start with INTERNAL_PREFIX): the conversation's state (ChatState: its system prompt
until the first turn, tools, marks) and the id of the commit that wrote it; the limits a
new agent's metadata is checked against, and a fork's metadata."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agentkv import ids
from agentkv.errors import CorruptRecord, InvalidArgument
from inference_worker.agents import SYSTEM_KEY
from inference_worker.conversation import ChatState, Mark
from inference_worker.tools import PLAIN_TOOLS_CHARS, pack_tools, unpack_tools

REPLY_OPEN = "agentkv.reply_open"
COMMIT_ID = "agentkv.commit"
LAST_ROLE = "agentkv.last_role"
OPENED = "agentkv.opened"
DIGEST = "agentkv.digest"
MARKS = "agentkv.marks"
# digest,name,call-id call-id;... of marks a caller named or after replies with tool calls
MARK_EXTRAS = "agentkv.mark_extras"
APPLIED = "agentkv.applied"
SYSTEM = "agentkv.system."  # + chunk index: the system prompt until the first turn
TOOLS = "agentkv.toolsz."  # + chunk index: the conversation's tools, packed (pack_tools)
PLAIN_TOOLS = "agentkv.tools."  # + chunk index: as written before they were packed
INTERNAL_PREFIX = "agentkv."  # metadata keys that are the worker's own, not the caller's
SYSTEM_CHUNK = 4096  # the store's longest metadata value
MAX_SYSTEM_CHUNKS = 16


def check_metadata(metadata: dict[str, str], system: str, tools: str = "") -> dict[str, str]:
    """The caller's metadata of a new agent, checked against the store's limits with room
    for what this worker adds at every save (its chat state, commit id, its tools, and the
    system prompt until the first turn): one that fits now but not then would never be
    saved."""
    own = {k: "x" * 64 for k in (REPLY_OPEN, LAST_ROLE, OPENED, DIGEST, COMMIT_ID, APPLIED)}
    own[MARKS] = "x" * SYSTEM_CHUNK  # the resume points: one value, trimmed to fit
    own[MARK_EXTRAS] = "x" * SYSTEM_CHUNK  # their names and replies' calls, where any
    own |= _chunks(SYSTEM, system) | tools_metadata(tools)
    try:
        ids.metadata({**metadata, **own})
    except InvalidArgument as exc:
        raise InvalidArgument(
            f"{exc.message}, with the {len(own)} entries and "
            f"{sum(len(k) + len(v) for k, v in own.items())} characters at most this worker "
            "keeps for an agent with this system prompt and tools"
        ) from None
    return metadata


def check_system(system: str) -> None:
    """Raises InvalidArgument for a system prompt longer than the manifest keeps for it."""
    if len(system) > SYSTEM_CHUNK * MAX_SYSTEM_CHUNKS:
        raise InvalidArgument(
            f"system prompt of {len(system)} characters is over the "
            f"{SYSTEM_CHUNK * MAX_SYSTEM_CHUNKS} an agent keeps until its first turn"
        )


def chat_metadata(chat: ChatState) -> dict[str, str]:
    """The conversation's state as manifest metadata (ChatState, which chat_state reads)."""
    out = {
        REPLY_OPEN: "1" if chat.reply_open else "0",
        LAST_ROLE: chat.last_role,
        OPENED: "1" if chat.opened else "0",
        DIGEST: chat.digest,
    } | _marks_metadata(chat.marks)
    if chat.applied:
        out[APPLIED] = chat.applied
    out |= _chunks(SYSTEM, "" if chat.opened else chat.system)
    return out | tools_metadata(chat.tools)


def tools_metadata(tools: str) -> dict[str, str]:
    """Tools as metadata: as text when workers before packing could read them (so they
    keep an agent's tools in a mixed fleet), packed past that."""
    if len(tools) <= PLAIN_TOOLS_CHARS:
        return _chunks(PLAIN_TOOLS, tools)
    return _chunks(TOOLS, pack_tools(tools))


def _chunks(prefix: str, text: str) -> dict[str, str]:
    """`text` as metadata values the store takes, keys `prefix` + their index."""
    return {
        f"{prefix}{i // SYSTEM_CHUNK}": text[i : i + SYSTEM_CHUNK]
        for i in range(0, len(text), SYSTEM_CHUNK)
    }


def _joined(prefix: str, metadata: dict[str, str]) -> str:
    """The text _chunks wrote under `prefix`."""
    chunks = sorted((int(k[len(prefix) :]), v) for k, v in metadata.items() if k.startswith(prefix))
    return "".join(v for _, v in chunks)


def chat_state(metadata: dict[str, str]) -> ChatState:
    """ChatState from a manifest's metadata; a manifest without it is an opened one. Tools
    that do not unpack are the record's corruption (no worker wrote them so)."""
    packed = _joined(TOOLS, metadata)
    try:
        packed = unpack_tools(packed) if packed else ""
    except ValueError as exc:
        raise CorruptRecord(f"the agent's stored tools cannot be read: {exc}") from None
    return ChatState(
        system=_joined(SYSTEM, metadata),
        opened=metadata.get(OPENED, "1") == "1",
        last_role=metadata.get(LAST_ROLE) or "assistant",
        reply_open=metadata.get(REPLY_OPEN) == "1",
        digest=metadata.get(DIGEST, ""),
        marks=_marks(metadata.get(MARKS, ""), metadata.get(MARK_EXTRAS, "")),
        applied=metadata.get(APPLIED, ""),
        tools=packed or _joined(PLAIN_TOOLS, metadata),
    )


def _marks_metadata(marks: tuple[Mark, ...]) -> dict[str, str]:
    """Marks as metadata: one value of them all, five fields each (as workers before names
    and calls wrote it, so that they read it still), and one of their names and replies'
    calls, by digest, where any has them (_extras)."""
    out = {MARKS: _latest(f"{m.digest},{m.end},{m.cached},{m.last_role},{int(m.reply_open)}"
                          for m in marks)}  # fmt: skip
    if extras := _extras(marks):
        out[MARK_EXTRAS] = extras
    return out


def _extras(marks: tuple[Mark, ...]) -> str:
    """The marks' names and their replies' calls, in one metadata value: every name (64
    take about 2,700 characters), and the latest replies' calls while they fit (a mark
    without its calls takes the tool results after it as given)."""
    kept = {m.digest: [m.name, ""] for m in marks if m.name or m.calls}

    def items() -> list[str]:
        return [f"{digest},{name},{calls}" for digest, (name, calls) in kept.items()]

    for m in reversed(marks):
        if m.calls:
            kept[m.digest][1] = " ".join(m.calls)
            if len(";".join(items())) > SYSTEM_CHUNK:
                kept[m.digest][1] = ""
                break
    return _latest(items())


def _latest(items: Iterable[str]) -> str:
    """The latest items that fit in one metadata value (all of 64 marks do)."""
    kept = list(items)
    while len(";".join(kept)) > SYSTEM_CHUNK:
        kept.pop(0)
    return ";".join(kept)


def _marks(text: str, extras: str = "") -> tuple[Mark, ...]:
    """Marks as chat_metadata writes them, with their names and their replies' calls; a
    manifest from before marks has none. Ones no worker wrote (too few fields, a position
    that is no number, or a cached part past the mark's end) are CorruptRecord."""
    more = {}
    marks = []
    try:
        for item in filter(None, extras.split(";")):
            digest, name, calls, *_ = item.split(",")  # later fields: a later worker's
            more[digest] = name, tuple(calls.split())
        for item in filter(None, text.split(";")):
            digest, end, cached, role, reply_open, *_ = item.split(",")
            if not (end.isdigit() and cached.isdigit() and int(cached) <= int(end)):
                raise ValueError(f"a mark at {end!r} with {cached!r} cached")
            extra = more.get(digest, ("", ()))
            marks.append(Mark(digest, int(end), int(cached), role, reply_open == "1", *extra))
    except ValueError as exc:  # unpacking too few fields is one too
        raise CorruptRecord(f"the agent's stored resume points cannot be read: {exc}") from None
    return tuple(marks)


def caller_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """What a restored agent carries on: the caller's metadata and its system prompt's digest
    (SYSTEM_KEY), not the worker's per-commit state."""
    return {
        k: v for k, v in metadata.items() if not k.startswith(INTERNAL_PREFIX) or k == SYSTEM_KEY
    }


def fork_metadata(source: Mapping[str, str], request_id: str) -> dict[str, str]:
    """A fork's metadata: its source's chat state and the caller's entries, with the fork's
    request_id, not the source's last commit, naming the write that made it (COMMIT_ID)."""
    metadata = {k: v for k, v in source.items() if k != COMMIT_ID}
    if request_id:
        metadata[COMMIT_ID] = request_id
    return metadata


def made_by_fork(metadata: Mapping[str, str], request_id: str) -> bool:
    """Whether the manifest is still as the fork with this request_id made it."""
    return bool(request_id) and metadata.get(COMMIT_ID) == request_id
