"""WorkerClient: the InferenceWorker RPCs with typed errors, and turns collected into results."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from agentkv.channels import ClientSecurity
from agentkv.client.messages import pb_messages
from agentkv.client.worker_core import BaseWorkerClient, TurnResult
from agentkv.errors import typed_errors
from agentkv.worker.v1 import worker_pb2 as pb

__all__ = ["TurnResult", "WorkerClient", "pb_messages"]
T = TypeVar("T")


class WorkerClient(BaseWorkerClient):
    """A connection to one inference worker. Thread-safe; close() when done."""

    def _open(self, security: ClientSecurity, address: str) -> grpc.Channel:
        return security.channel(address)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, request: Any) -> Any:
        with typed_errors():
            return getattr(self.stub, method)(request, timeout=self.timeout)

    def _unary(self, method: str, request: Any, unwrap: Callable[[Any], T]) -> T:
        return unwrap(self.call(method, request))

    def _stream(self, request: pb.TurnRequest, timeout: float) -> Iterator[pb.TurnResponse]:
        call = self.stub.Turn(request, timeout=timeout)
        try:
            with typed_errors():
                yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended

    @staticmethod
    def _collect(responses: Iterator[pb.TurnResponse]) -> TurnResult:
        result = TurnResult()
        for response in responses:
            result.add(response)
        return result

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
