"""WorkerClient: the InferenceWorker RPCs with typed errors, and turns collected into results."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from agentkv.channels import ClientSecurity
from agentkv.errors import from_rpc_error
from agentkv.worker.v1 import worker_pb2 as pb
from agentkv.worker.v1 import worker_pb2_grpc


@dataclass(slots=True)
class TurnResult:
    """A turn's reply as its responses arrive: text pieces, token ids, then the usage."""

    pieces: list[str] = field(default_factory=list)  # the non-empty text pieces, in order
    token_ids: list[int] = field(default_factory=list)
    usage: pb.Usage | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, response: pb.TurnResponse) -> None:
        """Takes one streamed response: a chunk of tokens, or the closing usage."""
        if response.HasField("tokens"):
            self.token_ids += response.tokens.token_ids
            if response.tokens.text:
                self.pieces.append(response.tokens.text)
        else:
            self.usage = response.usage


class WorkerClient:
    """A connection to one inference worker. Thread-safe; close() when done."""

    def __init__(
        self, address: str, timeout: float = 300.0, security: ClientSecurity | None = None
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = (security or ClientSecurity()).channel(address)
        self.stub = worker_pb2_grpc.InferenceWorkerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def create_agent(
        self, namespace: str, agent_id: str, system: str = "", **fields: Any
    ) -> pb.AgentState:
        request = pb.CreateAgentRequest(
            namespace=namespace, agent_id=agent_id, system_prompt=system, **fields
        )
        return self.call("CreateAgent", request).agent

    def stream_turn(
        self,
        namespace: str,
        agent_id: str,
        messages: Sequence[tuple[str, str]],
        *,
        phase: str = "",
        priority: int = 0,
        deadline_ms: int = 0,
        durable: bool = False,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[pb.TurnResponse]:
        """Streams a turn's responses: token chunks, then the usage."""
        request = pb.TurnRequest(
            namespace=namespace,
            agent_id=agent_id,
            messages=pb_messages(messages),
            sampling=pb.SamplingParams(**sampling),
            phase=phase,
            priority=priority,
            deadline_ms=deadline_ms,
            durable=durable,
        )
        try:
            yield from self.stub.Turn(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def turn(
        self, namespace: str, agent_id: str, messages: Sequence[tuple[str, str]], **options: Any
    ) -> TurnResult:
        """A whole turn: the reply's text, its token ids and the usage. Takes stream_turn's
        options and sampling fields."""
        result = TurnResult()
        for response in self.stream_turn(namespace, agent_id, messages, **options):
            result.add(response)
        return result

    def inject(
        self,
        namespace: str,
        agent_id: str,
        messages: Sequence[tuple[str, str]],
        *,
        phase: str = "",
        durable: bool = False,
    ) -> pb.InjectContextResponse:
        """Appends messages to the agent's context; only they are prefilled."""
        request = pb.InjectContextRequest(
            namespace=namespace,
            agent_id=agent_id,
            messages=pb_messages(messages),
            phase=phase,
            durable=durable,
        )
        return self.call("InjectContext", request)

    def fork(self, namespace: str, source: str, agent_id: str, phase: str = "") -> pb.AgentState:
        """A new agent that starts from `source`'s context, sharing its blocks in the store."""
        request = pb.ForkAgentRequest(
            namespace=namespace, source_agent_id=source, agent_id=agent_id, phase=phase
        )
        return self.call("ForkAgent", request).agent

    def evict(self, namespace: str, agent_id: str) -> pb.EvictAgentResponse:
        return self.call("EvictAgent", pb.EvictAgentRequest(namespace=namespace, agent_id=agent_id))

    def describe(self, namespace: str, agent_id: str) -> pb.AgentState:
        request = pb.DescribeAgentRequest(namespace=namespace, agent_id=agent_id)
        return self.call("DescribeAgent", request).agent

    def wait_durable(self, namespace: str, agent_id: str, timeout: float = 60.0) -> None:
        """Waits until every token in the agent's cache is committed to the store (a reply
        never waits for the disk; this does). Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.describe(namespace, agent_id)
            if state.persisted_tokens >= state.num_tokens - 1:  # a last generated token
                return  # is not in the cache until the next turn feeds it
            time.sleep(0.01)
        raise TimeoutError(f"{namespace}/{agent_id} was not durable within {timeout:.0f} s")

    def delete(self, namespace: str, agent_id: str) -> bool:
        request = pb.DeleteAgentRequest(namespace=namespace, agent_id=agent_id)
        return self.call("DeleteAgent", request).deleted

    def info(self) -> pb.GetWorkerInfoResponse:
        return self.call("GetWorkerInfo", pb.GetWorkerInfoRequest())


def pb_messages(messages: Sequence[tuple[str, str]]) -> list[pb.Message]:
    return [pb.Message(role=role, content=content) for role, content in messages]
