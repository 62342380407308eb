"""The workers' model as the gateway's clients see it: its id (--model-name, else the first
worker's model), its fingerprint (what tells its anonymous agents from another model's), and
a question asked of the first worker that answers."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from agentkv.client.routing import Down
from agentkv.errors import AgentKVError
from agentkv.gateway.config import INFO_TIMEOUT
from agentkv.gateway.errors import HTTPError

T = TypeVar("T")
PASSED_FOR = 30.0  # seconds a worker first_worker passed by is asked after the others
PASSED_BY = {  # what a worker answers that another may not: first_worker asks the next
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,  # an older worker, during a rolling upgrade
    grpc.StatusCode.UNAUTHENTICATED,  # the gateway's --upstream-* credentials, not the client's
    grpc.StatusCode.PERMISSION_DENIED,
}


def model_id(model: str) -> str:
    """What clients call the workers' model: its --model name, or a path's last part (a
    GGUF file's without .gguf)."""
    name = Path(model).name if "/" in model else model
    return name.removesuffix(".gguf")


class Served:
    """The model the workers serve, asked of them once; `workers`: their clients by address."""

    def __init__(self, workers: dict[str, Any], model_name: str) -> None:
        self.workers, self.model_id = workers, model_name
        self.fingerprint = ""  # the workers' model's, once asked (info)
        self.passed = Down(PASSED_FOR)  # the workers first_worker passed by

    async def model(self) -> str:
        """The served model's id: --model-name, else the first worker's model."""
        if not self.model_id:
            self.model_id = model_id((await self.info()).model)
        return self.model_id

    async def info(self) -> Any:
        """The first worker's GetWorkerInfo that answers; 503 when none does. Its
        fingerprint is kept."""
        info = await self.first_worker(lambda worker: worker.info())
        self.fingerprint = info.fingerprint
        return info

    async def first_worker(self, ask: Callable[[Any], Awaitable[T]]) -> T:
        """ask(worker) of the first worker that answers. One that cannot (unreachable, slow,
        too old for the call, refusing the gateway's own credentials) is passed by; any
        other error is the request's, raised. None answers: a 503 saying the last why."""
        last = "no worker is configured"
        for address in self.passed.last(list(self.workers)):  # a hung one cost every call
            try:
                answer = await asyncio.wait_for(ask(self.workers[address]), INFO_TIMEOUT)
                self.passed.mark_up(address)
                return answer
            except AgentKVError as exc:
                if exc.code not in PASSED_BY:
                    raise
                last = f"{address}: {exc.message}"
            except TimeoutError:
                last = f"{address}: no answer within {INFO_TIMEOUT:g} s"
            self.passed.mark_down(address)
        message = f"no worker answers (last: {last})"
        raise HTTPError(503, message, "service_unavailable", code="unavailable", retry=True)

    async def model_key(self) -> str:
        """A short hash of the workers' model fingerprint: what tells this model's anonymous
        agents from another's made for the same conversation."""
        fingerprint = self.fingerprint or (await self.info()).fingerprint
        return hashlib.blake2b(fingerprint.encode(), digest_size=4).hexdigest()
