"""Typed errors shared by the store, the worker and the SDK, and their gRPC status codes.

Domain code raises these; one server interceptor turns them into a status, a message and
trailing metadata; the SDK turns a status back into the same class.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

ERROR_KEY = "agentkv-error"
GENERATION_KEY = "agentkv-current-generation"
RESUMED_KEY = "agentkv-resumed-at"  # TurnsFollow's resumed_at


class AgentKVError(Exception):
    """Base of every agentkv error; `code` is the gRPC status it travels as."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    remote = False  # raised by an agentkv server (not by the transport or the SDK)
    peer = ""  # the kind of server a client call went to ("store"), where the client says

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The error's name for the wire: its class, or the nearest base this module
        defines (a server's own subclass, the store's ObjectStoreDown, goes as Unavailable):
        every name sent is one store.proto lists."""
        shared = next(c for c in type(self).__mro__ if ERRORS.get(c.__name__) is c)
        return ((ERROR_KEY, shared.__name__),)


class InvalidArgument(AgentKVError):
    """A request is malformed: a bad id, dtype, shape, byte count or size."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(AgentKVError):
    code = grpc.StatusCode.NOT_FOUND


class AgentNotFound(NotFound):
    pass


class BlockNotFound(NotFound):
    pass


class MarkNotFound(NotFound):
    """An agent's conversation has no such point (a turn's Usage.mark) to continue from."""


class AgentExists(AgentKVError):
    code = grpc.StatusCode.ALREADY_EXISTS


class SystemPromptDiffers(AgentExists):
    """An agent of that id exists, made with another system prompt."""


class FailedPrecondition(AgentKVError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class FingerprintMismatch(FailedPrecondition):
    """A block or agent was written under another model or KV format."""


class ModelLacks(FailedPrecondition):
    """A request needs what this worker's model lacks (a tool-call format, calls as JSON,
    calls that open with a special token): not a state that may change, a bad request for
    this model (an HTTP 400)."""


class AgentBusy(FailedPrecondition):
    """The agent has a turn under way: the call may be sent again once it ends."""


class _WithCount:
    """An error that carries a count besides its message, in its attribute `count_name`:
    kept when pickled or copied, and sent as the trailing metadata `count_key`, from which
    from_rpc_error reads it back."""

    count_name: str
    count_key: str
    message: str

    def __reduce__(self) -> tuple:  # pickled and copied with both arguments
        return (type(self), (self.message, getattr(self, self.count_name)))

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        count = (self.count_key, str(getattr(self, self.count_name)))
        return (*super().trailing_metadata(), count)  # the error class's, then the count


class TurnsFollow(_WithCount, FailedPrecondition):
    """A turn asked to continue from its agent's last point, and later turns follow it; or
    a resent conversation would drop points that turns named (keep_named_marks).
    `resumed_at`: then, how many of its messages the agent's context there covers."""

    count_name, count_key = "resumed_at", RESUMED_KEY

    def __init__(self, message: str, resumed_at: int = 0) -> None:
        super().__init__(message)
        self.resumed_at = resumed_at


class GenerationConflict(_WithCount, AgentKVError):
    """A compare-and-swap commit lost: the agent is at another generation."""

    code = grpc.StatusCode.ABORTED
    count_name, count_key = "current_generation", GENERATION_KEY

    def __init__(self, message: str, current_generation: int) -> None:
        super().__init__(message)
        self.current_generation = current_generation


class TurnTaken(AgentKVError):
    """A retried turn (its request_id) that the agent already took, whose reply was lost: it
    is not run again, and its reply cannot be sent again."""

    code = grpc.StatusCode.ALREADY_EXISTS


class OutOfRange(AgentKVError):
    """A context would grow past the model's limit."""

    code = grpc.StatusCode.OUT_OF_RANGE


class OverBudget(OutOfRange):
    """A turn whose KV cache could never fit the worker's whole memory budget."""


class CorruptBlock(AgentKVError):
    """A payload failed its checksum, was truncated or vanished; it has been quarantined."""

    code = grpc.StatusCode.DATA_LOSS


class BlockMisfit(CorruptBlock):
    """Blocks whose tensors do not fit the reader's model (found by the reader, not a
    checksum); `keys` names them."""

    def __init__(self, message: str, keys: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.keys = keys or []


class CorruptRecord(AgentKVError):
    """An index record (an agent's manifest, a block's record) failed its checksum or would
    not decode; the store quarantines it. `table` and `key` name it in the index."""

    code = grpc.StatusCode.DATA_LOSS

    def __init__(self, message: str, table: str = "", key: bytes = b"") -> None:
        super().__init__(message)
        self.table = table
        self.key = key


class AgentLost(CorruptRecord):
    """An agent whose manifest cannot be read (quarantined here, or unreadable in the object
    store): a delete, or a commit anew, goes on without it."""


class IndexUnusable(AgentKVError):
    """The store's index cannot be opened: another schema version, a damaged schema record,
    or LMDB's own structures damaged. Raised at start-up; the store does not serve."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(AgentKVError):
    """Out of a resource: a quota, the disk, or gRPC's message-size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class QuotaExceeded(ResourceExhausted):
    # Raised by the store for an agent record that grew past a quota: (namespace, or None
    # for the store's quota; the quota; bytes grown), for it to make room and try again.
    room: tuple[str | None, int, int] | None = None


class NamespaceQuotaExceeded(QuotaExceeded):
    """A namespace's own quota (--namespace-quota) is reached: its tenant's doing, unlike
    the store's quota or a full disk, which every tenant shares."""


class DiskFull(ResourceExhausted):
    pass


class ServerBusy(ResourceExhausted):
    """A worker's turn queue or memory budget, or a store's stream slots, are full for now:
    worth sending again shortly, unlike a quota or a full disk, which stay so until someone
    acts."""


class ReplyTooLarge(ResourceExhausted):
    """A reply would pass the message-size limit; nothing was done: ask for less per request."""


class Unavailable(AgentKVError):
    """The peer could not be reached, or cannot serve the call now (a store whose data
    directory went away): worth sending again later."""

    code = grpc.StatusCode.UNAVAILABLE


class BucketUnreachable(Unavailable):
    """The store's object store does not answer, and the agent asked for is not on the
    store's disk: it may be in the bucket. A write of it goes on locally, so a worker that
    creates it goes on (its upload will not overwrite one made elsewhere)."""


class NotCommitted(Unavailable):
    """A worker could not commit an agent's latest state: its store did not answer. That
    state is in the worker's RAM alone, and is written once the store takes it, so the
    agent's next turns belong at that worker. (A full store's refusal keeps its own
    RESOURCE_EXHAUSTED class.)"""


class DeadlineExceeded(AgentKVError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(AgentKVError):
    """No bearer token, or one the server does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(AgentKVError):
    """A valid token used for a namespace it may not touch."""

    code = grpc.StatusCode.PERMISSION_DENIED


# Every class above by name: a server's trailing metadata names the one it raised.
ERRORS: dict[str, type[AgentKVError]] = {
    name: cls
    for name, cls in list(globals().items())
    if isinstance(cls, type) and issubclass(cls, AgentKVError)
}
# By status code, the first class above with that code (a base comes before its subclasses):
# what a status without the trailer (from a proxy or the transport) becomes.
_BY_CODE: dict[grpc.StatusCode, type[AgentKVError]] = {
    cls.code: cls for cls in reversed(ERRORS.values())
}


# gRPC's reason for a connection whose server answered, but not in HTTP/2 (an HTTP/1 server,
# say): no gRPC server, nor a proxy to one (that speaks HTTP/2 even while its backend is down).
NOT_HTTP2 = "Failed parsing HTTP/2"


def connect_failure(message: str) -> str:
    """gRPC's reason in its "failed to connect to all addresses; last error: CODE: PEER:
    REASON" message: "Connection refused", "Failed parsing HTTP/2 (...)"."""
    return message.rpartition("last error: ")[2].split(": ", 2)[-1].removesuffix(": OK")


def in_one_line(exc: BaseException, limit: int = 300) -> str:
    """Another library's exception as part of a one-line error: its type and the first line
    of what it says, cut at `limit` characters (some quote a whole file)."""
    said = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {said if len(said) <= limit else said[:limit] + '...'}"


def os_error_words(exc: OSError) -> str:
    """An OSError in words, without its errno: "Read-only file system: PATH"."""
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc)


def from_rpc_error(error: grpc.RpcError) -> AgentKVError:
    """Rebuilds the typed error a server raised from the status and trailing metadata."""
    code = error.code()
    message = error.details() or code.name
    metadata = dict(error.trailing_metadata() or ())
    if "ping timeout" in message and ERROR_KEY not in metadata:  # the client's keepalive
        message = f"no answer to a keepalive ping: hung, or its link is down ({message})"
    if code == grpc.StatusCode.UNIMPLEMENTED and ERROR_KEY not in metadata:  # gRPC's own
        message = (
            f"the server there does not serve this call ({message}): an older agentkv that "
            "lacks it, or another kind of service (a store's address where a worker's "
            "belongs, or the other way round)"
        )
    cls = ERRORS.get(metadata.get(ERROR_KEY, ""), _BY_CODE.get(code, AgentKVError))
    if issubclass(cls, _WithCount):
        count = metadata.get(cls.count_key, "0")
        result = cls(message, int(count) if count.isdigit() else 0)
    else:
        result = cls(message)
        result.code = code
    result.remote = ERROR_KEY in metadata
    return result


@contextmanager
def typed_errors(peer: str = "") -> Iterator[None]:
    """A gRPC error raised inside leaves as its agentkv class (from_rpc_error), saying which
    kind of server it came from (`peer`, e.g. "store"), when given."""
    try:
        yield
    except grpc.RpcError as exc:
        error = from_rpc_error(exc)
        error.peer = peer or error.peer
        raise error from None
