from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "fit_max_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    fit_max_tokens: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., fit_max_tokens: _Optional[bool] = ...) -> None: ...

class CreateAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "system_prompt", "phase", "metadata", "tools", "durable")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    system_prompt: str
    phase: str
    metadata: _containers.ScalarMap[str, str]
    tools: str
    durable: bool
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., system_prompt: _Optional[str] = ..., phase: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., tools: _Optional[str] = ..., durable: _Optional[bool] = ...) -> None: ...

class CreateAgentResponse(_message.Message):
    __slots__ = ("agent", "usage")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    agent: AgentState
    usage: Usage
    def __init__(self, agent: _Optional[_Union[AgentState, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "messages", "sampling", "phase", "priority", "deadline_ms", "durable", "whole_conversation", "request_id", "tools", "max_tool_calls", "format", "tool_call_required", "tool_call_name", "tool_call_forbidden", "after_mark", "after_mark_last", "mark_name", "tool_call_allowed", "keep_named_marks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORBIDDEN_FIELD_NUMBER: _ClassVar[int]
    AFTER_MARK_FIELD_NUMBER: _ClassVar[int]
    AFTER_MARK_LAST_FIELD_NUMBER: _ClassVar[int]
    MARK_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    KEEP_NAMED_MARKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    sampling: SamplingParams
    phase: str
    priority: int
    deadline_ms: int
    durable: bool
    whole_conversation: bool
    request_id: str
    tools: str
    max_tool_calls: int
    format: OutputFormat
    tool_call_required: bool
    tool_call_name: str
    tool_call_forbidden: bool
    after_mark: str
    after_mark_last: bool
    mark_name: str
    tool_call_allowed: _containers.RepeatedScalarFieldContainer[str]
    keep_named_marks: bool
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., phase: _Optional[str] = ..., priority: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., durable: _Optional[bool] = ..., whole_conversation: _Optional[bool] = ..., request_id: _Optional[str] = ..., tools: _Optional[str] = ..., max_tool_calls: _Optional[int] = ..., format: _Optional[_Union[OutputFormat, _Mapping]] = ..., tool_call_required: _Optional[bool] = ..., tool_call_name: _Optional[str] = ..., tool_call_forbidden: _Optional[bool] = ..., after_mark: _Optional[str] = ..., after_mark_last: _Optional[bool] = ..., mark_name: _Optional[str] = ..., tool_call_allowed: _Optional[_Iterable[str]] = ..., keep_named_marks: _Optional[bool] = ...) -> None: ...

class OutputFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "reused_hot_tokens", "reused_store_tokens", "prefilled_tokens", "generated_tokens", "time_to_first_token_ms", "decode_tokens_per_second", "cache_state", "finish_reason", "restore_path", "restore_failure", "restored_bytes", "stop_sequence", "mark")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_HOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CACHE_STATE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PATH_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    reused_hot_tokens: int
    reused_store_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    time_to_first_token_ms: float
    decode_tokens_per_second: float
    cache_state: str
    finish_reason: str
    restore_path: str
    restore_failure: str
    restored_bytes: int
    stop_sequence: str
    mark: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., reused_hot_tokens: _Optional[int] = ..., reused_store_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., time_to_first_token_ms: _Optional[float] = ..., decode_tokens_per_second: _Optional[float] = ..., cache_state: _Optional[str] = ..., finish_reason: _Optional[str] = ..., restore_path: _Optional[str] = ..., restore_failure: _Optional[str] = ..., restored_bytes: _Optional[int] = ..., stop_sequence: _Optional[str] = ..., mark: _Optional[str] = ...) -> None: ...

class TurnResponse(_message.Message):
    __slots__ = ("tokens", "usage", "tool_call", "started")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    usage: Usage
    tool_call: ToolCall
    started: Usage
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., started: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class InjectContextRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "messages", "phase", "priority", "deadline_ms", "durable", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    phase: str
    priority: int
    deadline_ms: int
    durable: bool
    request_id: str
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., phase: _Optional[str] = ..., priority: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., durable: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class InjectContextResponse(_message.Message):
    __slots__ = ("agent", "usage")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    agent: AgentState
    usage: Usage
    def __init__(self, agent: _Optional[_Union[AgentState, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ForkAgentRequest(_message.Message):
    __slots__ = ("namespace", "source_agent_id", "agent_id", "phase", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    source_agent_id: str
    agent_id: str
    phase: str
    request_id: str
    def __init__(self, namespace: _Optional[str] = ..., source_agent_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., phase: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ForkAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentState
    def __init__(self, agent: _Optional[_Union[AgentState, _Mapping]] = ...) -> None: ...

class EvictAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ...) -> None: ...

class EvictAgentResponse(_message.Message):
    __slots__ = ("evicted", "bytes_freed")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    evicted: bool
    bytes_freed: int
    def __init__(self, evicted: _Optional[bool] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class DescribeAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ...) -> None: ...

class AgentState(_message.Message):
    __slots__ = ("namespace", "agent_id", "tier", "num_tokens", "num_bytes", "persisted_tokens", "generation", "phase", "pinned")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    tier: str
    num_tokens: int
    num_bytes: int
    persisted_tokens: int
    generation: int
    phase: str
    pinned: bool
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., tier: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., persisted_tokens: _Optional[int] = ..., generation: _Optional[int] = ..., phase: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class DescribeAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentState
    def __init__(self, agent: _Optional[_Union[AgentState, _Mapping]] = ...) -> None: ...

class DeleteAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ...) -> None: ...

class DeleteAgentResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerInfoResponse(_message.Message):
    __slots__ = ("model", "fingerprint", "kv_format", "block_tokens", "max_context", "device", "blas", "hot_budget_bytes", "hot_bytes", "num_hot_agents", "dtype", "tool_parser", "features")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLAS_FIELD_NUMBER: _ClassVar[int]
    HOT_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOT_AGENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    kv_format: str
    block_tokens: int
    max_context: int
    device: str
    blas: str
    hot_budget_bytes: int
    hot_bytes: int
    num_hot_agents: int
    dtype: str
    tool_parser: str
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kv_format: _Optional[str] = ..., block_tokens: _Optional[int] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., blas: _Optional[str] = ..., hot_budget_bytes: _Optional[int] = ..., hot_bytes: _Optional[int] = ..., num_hot_agents: _Optional[int] = ..., dtype: _Optional[str] = ..., tool_parser: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("messages", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: str
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[str] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("prompt_tokens",)
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ...) -> None: ...

class PinAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "pinned")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    pinned: bool
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentState
    def __init__(self, agent: _Optional[_Union[AgentState, _Mapping]] = ...) -> None: ...
