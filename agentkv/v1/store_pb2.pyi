from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PutBlockHeader(_message.Message):
    __slots__ = ("namespace", "fingerprint", "parent_key", "token_ids", "tensors")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    parent_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutBlockHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PutBlockHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutBlockResult(_message.Message):
    __slots__ = ("key", "num_tokens", "num_bytes", "deduplicated")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    num_tokens: int
    num_bytes: int
    deduplicated: bool
    def __init__(self, key: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., deduplicated: _Optional[bool] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("blocks", "lease_id", "lease_expires_unix_ms")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[PutBlockResult]
    lease_id: str
    lease_expires_unix_ms: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[PutBlockResult, _Mapping]]] = ..., lease_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "keys", "layers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "layer", "file_offset", "num_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FILE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    layer: int
    file_offset: int
    num_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., layer: _Optional[int] = ..., file_offset: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("key", "parent_key", "token_ids", "tensors", "num_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    num_bytes: int
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class LocateBlocksRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "keys", "layers", "lease_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    layers: _containers.RepeatedScalarFieldContainer[int]
    lease_seconds: int
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., layers: _Optional[_Iterable[int]] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("layer", "offset", "num_bytes", "checksum")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    num_bytes: int
    checksum: int
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., num_bytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("key", "parent_key", "token_ids", "path", "tensors", "segments")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    path: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class LocateBlocksResponse(_message.Message):
    __slots__ = ("lease_id", "lease_expires_unix_ms", "blocks", "checksum_algorithm")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_expires_unix_ms: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    checksum_algorithm: str
    def __init__(self, lease_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., checksum_algorithm: _Optional[str] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ReportCorruptBlockRequest(_message.Message):
    __slots__ = ("namespace", "key", "reason", "does_not_fit")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DOES_NOT_FIT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    reason: str
    does_not_fit: bool
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., reason: _Optional[str] = ..., does_not_fit: _Optional[bool] = ...) -> None: ...

class ReportCorruptBlockResponse(_message.Message):
    __slots__ = ("quarantined",)
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    quarantined: bool
    def __init__(self, quarantined: _Optional[bool] = ...) -> None: ...

class FindLongestPrefixRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "token_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FindLongestPrefixResponse(_message.Message):
    __slots__ = ("num_tokens", "keys", "block_num_tokens")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_tokens: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AgentManifest(_message.Message):
    __slots__ = ("namespace", "agent_id", "fingerprint", "token_ids", "block_keys", "block_num_tokens", "metadata", "phase", "created_unix_ms", "updated_unix_ms", "generation", "missing_block_keys", "num_bytes", "remote_block_keys")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    fingerprint: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    metadata: _containers.ScalarMap[str, str]
    phase: str
    created_unix_ms: int
    updated_unix_ms: int
    generation: int
    missing_block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_bytes: int
    remote_block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., block_num_tokens: _Optional[_Iterable[int]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., phase: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., generation: _Optional[int] = ..., missing_block_keys: _Optional[_Iterable[bytes]] = ..., num_bytes: _Optional[int] = ..., remote_block_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "fingerprint", "expected_generation", "token_ids", "block_keys", "metadata", "phase", "release_lease_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    fingerprint: str
    expected_generation: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    metadata: _containers.ScalarMap[str, str]
    phase: str
    release_lease_id: str
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., expected_generation: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., phase: _Optional[str] = ..., release_lease_id: _Optional[str] = ...) -> None: ...

class CommitAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentManifest
    def __init__(self, agent: _Optional[_Union[AgentManifest, _Mapping]] = ...) -> None: ...

class GetAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "fingerprint", "summary_only", "peek")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_ONLY_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    fingerprint: str
    summary_only: bool
    peek: bool
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., summary_only: _Optional[bool] = ..., peek: _Optional[bool] = ...) -> None: ...

class GetAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentManifest
    def __init__(self, agent: _Optional[_Union[AgentManifest, _Mapping]] = ...) -> None: ...

class ListAgentsRequest(_message.Message):
    __slots__ = ("namespace", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class AgentSummary(_message.Message):
    __slots__ = ("agent_id", "fingerprint", "num_tokens", "num_blocks", "num_bytes", "phase", "updated_unix_ms", "generation")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    fingerprint: str
    num_tokens: int
    num_blocks: int
    num_bytes: int
    phase: str
    updated_unix_ms: int
    generation: int
    def __init__(self, agent_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., phase: _Optional[str] = ..., updated_unix_ms: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ListAgentsResponse(_message.Message):
    __slots__ = ("agents", "next_page_token")
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    agents: _containers.RepeatedCompositeFieldContainer[AgentSummary]
    next_page_token: str
    def __init__(self, agents: _Optional[_Iterable[_Union[AgentSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAgentRequest(_message.Message):
    __slots__ = ("namespace", "agent_id", "expected_generation")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    agent_id: str
    expected_generation: int
    def __init__(self, namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., expected_generation: _Optional[int] = ...) -> None: ...

class DeleteAgentResponse(_message.Message):
    __slots__ = ("num_blocks_released",)
    NUM_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_released: int
    def __init__(self, num_blocks_released: _Optional[int] = ...) -> None: ...

class ForkAgentRequest(_message.Message):
    __slots__ = ("namespace", "source_agent_id", "new_agent_id", "num_tokens", "phase", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    source_agent_id: str
    new_agent_id: str
    num_tokens: int
    phase: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, namespace: _Optional[str] = ..., source_agent_id: _Optional[str] = ..., new_agent_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., phase: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ForkAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentManifest
    def __init__(self, agent: _Optional[_Union[AgentManifest, _Mapping]] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("name", "num_agents", "num_blocks", "num_bytes", "quota_bytes", "agent_idle_seconds", "num_record_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_AGENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGENT_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_agents: int
    num_blocks: int
    num_bytes: int
    quota_bytes: int
    agent_idle_seconds: float
    num_record_bytes: int
    def __init__(self, name: _Optional[str] = ..., num_agents: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., agent_idle_seconds: _Optional[float] = ..., num_record_bytes: _Optional[int] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("namespace", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class BlockSummary(_message.Message):
    __slots__ = ("key", "parent_key", "fingerprint", "num_tokens", "num_bytes", "refcount", "last_access_unix_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    fingerprint: str
    num_tokens: int
    num_bytes: int
    refcount: int
    last_access_unix_ms: int
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., refcount: _Optional[int] = ..., last_access_unix_ms: _Optional[int] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSummary]
    next_page_token: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_namespaces", "num_agents", "num_blocks", "num_bytes", "quota_bytes", "num_evicted_blocks", "num_evicted_agents", "num_quarantined", "num_leases", "disk_free_bytes", "num_demoted_blocks", "num_rehydrated_blocks", "object_store", "object_store_state", "object_queue_depth", "object_put_bytes", "object_get_bytes", "num_expired_agents")
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_AGENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_AGENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REHYDRATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_STORE_FIELD_NUMBER: _ClassVar[int]
    OBJECT_STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    OBJECT_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    OBJECT_PUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_GET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_AGENTS_FIELD_NUMBER: _ClassVar[int]
    num_namespaces: int
    num_agents: int
    num_blocks: int
    num_bytes: int
    quota_bytes: int
    num_evicted_blocks: int
    num_evicted_agents: int
    num_quarantined: int
    num_leases: int
    disk_free_bytes: int
    num_demoted_blocks: int
    num_rehydrated_blocks: int
    object_store: str
    object_store_state: str
    object_queue_depth: int
    object_put_bytes: int
    object_get_bytes: int
    num_expired_agents: int
    def __init__(self, num_namespaces: _Optional[int] = ..., num_agents: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ..., num_evicted_agents: _Optional[int] = ..., num_quarantined: _Optional[int] = ..., num_leases: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., num_demoted_blocks: _Optional[int] = ..., num_rehydrated_blocks: _Optional[int] = ..., object_store: _Optional[str] = ..., object_store_state: _Optional[str] = ..., object_queue_depth: _Optional[int] = ..., object_put_bytes: _Optional[int] = ..., object_get_bytes: _Optional[int] = ..., num_expired_agents: _Optional[int] = ...) -> None: ...

class VerifyBlocksRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class CorruptBlockInfo(_message.Message):
    __slots__ = ("namespace", "key", "reason")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    reason: str
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class CorruptRecordInfo(_message.Message):
    __slots__ = ("table", "namespace", "id", "reason")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    table: str
    namespace: str
    id: str
    reason: str
    def __init__(self, table: _Optional[str] = ..., namespace: _Optional[str] = ..., id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class VerifyBlocksResponse(_message.Message):
    __slots__ = ("num_checked", "num_bytes", "corrupt", "corrupt_records", "num_remote")
    NUM_CHECKED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_FIELD_NUMBER: _ClassVar[int]
    num_checked: int
    num_bytes: int
    corrupt: _containers.RepeatedCompositeFieldContainer[CorruptBlockInfo]
    corrupt_records: _containers.RepeatedCompositeFieldContainer[CorruptRecordInfo]
    num_remote: int
    def __init__(self, num_checked: _Optional[int] = ..., num_bytes: _Optional[int] = ..., corrupt: _Optional[_Iterable[_Union[CorruptBlockInfo, _Mapping]]] = ..., corrupt_records: _Optional[_Iterable[_Union[CorruptRecordInfo, _Mapping]]] = ..., num_remote: _Optional[int] = ...) -> None: ...

class CollectGarbageRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class CollectGarbageResponse(_message.Message):
    __slots__ = ("num_blocks_deleted", "num_bytes_freed", "num_orphans_removed")
    NUM_BLOCKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    NUM_ORPHANS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_deleted: int
    num_bytes_freed: int
    num_orphans_removed: int
    def __init__(self, num_blocks_deleted: _Optional[int] = ..., num_bytes_freed: _Optional[int] = ..., num_orphans_removed: _Optional[int] = ...) -> None: ...
