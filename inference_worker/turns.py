"""What a turn carries between the RPC thread and the MLX thread."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from inference_worker.conversation import ChatMessage
from inference_worker.grammar import Forms
from inference_worker.sampling import Sampling
from inference_worker.tools import ToolCall

END = object()  # closes a turn's event stream


@dataclass(slots=True)
class TokenEvent:
    text: str
    token_ids: list[int]
    calls: list[ToolCall] = field(default_factory=list)  # written whole with these tokens


@dataclass(slots=True)
class StartEvent:
    """The prompt's usage, just before the first generated token (a copy: generated 1)."""

    usage: UsageEvent


@dataclass(slots=True)
class UsageEvent:
    prompt_tokens: int = 0
    reused_hot_tokens: int = 0
    reused_store_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    decode_tokens_per_second: float = 0.0
    cache_state: str = ""
    finish_reason: str = "none"
    restore_path: str = ""
    restore_failure: str = ""
    restored_bytes: int = 0
    stop_sequence: str = ""  # the stop string that ended the reply
    mark: str = ""  # the conversation's point after the turn (conversation.Mark's digest)


@dataclass(slots=True)
class TurnJob:
    namespace: str
    agent_id: str
    messages: list[ChatMessage]
    sampling: Sampling
    phase: str = ""
    started: float = field(default_factory=time.perf_counter)
    priority: int = 0
    deadline_ms: int = 0
    durable: bool = False  # the usage waits for the store commit
    # `messages` are the whole conversation, resent (conversation.resume), not only what is new
    whole_conversation: bool = False
    # `messages` follow this mark of the agent's conversation (conversation.continued), not its end;
    # with after_mark_last, only if it is the last
    after_mark: str = ""
    after_mark_last: bool = False
    mark_name: str = ""  # what the turn's mark is named, besides its digest
    keep_named_marks: bool = False  # a resent conversation may not drop a named mark
    request_id: str = ""  # a turn's or an injection's idempotency key
    creates: bool = False  # a new agent's system prompt (Engine.create_agent)
    tools: str = ""  # the tools (tools.canonical_tools): the agent's, or the conversation's
    max_tool_calls: int = 0  # the reply ends after this many calls; 0: no limit
    forms: Forms | None = None  # the reply's required form (structured output), compiled
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # a token was handed to the turn's stream while its call was live (set by the RPC
    # thread): a turn whose caller left before that goes back, as it saw nothing of it
    streamed: bool = False
    error: Exception | None = None  # set when the turn failed after it started

    @property
    def own_tools(self) -> bool:
        """Whether the agent's own tools apply, known only at the turn's start: it sends no
        tools, nor the whole conversation (whose tools are the ones it sends)."""
        return not (self.tools or self.whole_conversation)

    def end(self, usage: UsageEvent | None = None, error: Exception | None = None) -> None:
        """Closes the event stream: the usage, if any, then END; `error` is what it raises."""
        self.error = error
        if usage is not None:
            self.events.put(usage)
        self.events.put(END)


@dataclass(slots=True)
class AgentInfo:
    namespace: str
    agent_id: str
    tier: str
    num_tokens: int
    num_bytes: int
    persisted_tokens: int
    generation: int
    phase: str
    pinned: bool = False
