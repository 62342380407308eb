"""Which worker serves an agent: rendezvous hashing, with failover past workers that are down.

Every agent ranks every worker by a hash of (worker, agent) and goes to the highest that is
up. The ranking depends on nothing else, so every client sends an agent to the same worker
(which holds it hot), and a worker joining or leaving moves only the agents it wins or held.
A worker that fails to answer is skipped for `down_for` seconds; the agent's next-ranked
worker restores it warm from the store.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from agentkv.addresses import client_address
from agentkv.errors import Unavailable


def rank(workers: Sequence[str], key: str) -> list[str]:
    """Workers in rendezvous order for `key`: highest hash of (worker, key) first."""

    def score(worker: str) -> bytes:
        return hashlib.blake2b(f"{worker}\0{key}".encode(), digest_size=8).digest()

    return sorted(workers, key=score, reverse=True)


class Down:
    """Workers that failed to answer, each skipped for `down_for` seconds. Thread-safe."""

    def __init__(self, down_for: float) -> None:
        self.down_for = down_for
        self._down: dict[str, float] = {}  # worker -> when it was marked down
        self._lock = threading.Lock()

    def last(self, workers: list[str]) -> list[str]:
        """`workers` in their order, those down moved last."""
        since = time.monotonic() - self.down_for
        with self._lock:
            down = {w for w, at in self._down.items() if at > since}
        return [w for w in workers if w not in down] + [w for w in workers if w in down]

    def mark_down(self, worker: str) -> None:
        with self._lock:
            self._down[worker] = time.monotonic()

    def was_down(self, worker: str) -> bool:
        """Whether the worker was marked down and has not answered since (its time out may
        have passed: it is tried again, but may well be down still)."""
        with self._lock:
            return worker in self._down

    def mark_up(self, worker: str) -> None:
        with self._lock:
            self._down.pop(worker, None)


class Router(Down):
    """Rendezvous order with failover. Thread-safe."""

    def __init__(self, workers: Sequence[str], down_for: float = 5.0) -> None:
        if not workers:
            raise ValueError("at least one worker address is needed")
        if len(set(workers)) != len(workers):
            raise ValueError(f"worker addresses repeat: {list(workers)}")
        for address in workers:
            client_address(address)  # ValueError: "an address must be HOST:PORT or ..."
        super().__init__(down_for)
        self.workers = list(workers)

    def candidates(self, key: str) -> list[str]:
        """Workers to try for `key`, in order: those up by rank, then those down by rank."""
        return self.last(rank(self.workers, key))

    def home(self, key: str) -> str:
        """The worker `key` goes to now."""
        return self.candidates(key)[0]


@dataclass
class Attempts:
    """The tries of one routed call, I/O-free (the sync and asyncio SDKs share it): the
    agent's workers in order, round after round, `backoff` seconds (doubling) between rounds.
    """

    router: Router
    key: str
    retries: int
    backoff: float
    tried: list[str] = field(default_factory=list)
    last: str = ""  # why the last try failed, gRPC's words

    def __iter__(self) -> Iterator[tuple[float, str]]:
        """(seconds to wait first, worker address) for every try."""
        for attempt in range(self.retries + 1):
            delay = self.backoff * 2 ** (attempt - 1) if attempt else 0.0
            for i, address in enumerate(self.router.candidates(self.key)):
                yield (delay if i == 0 else 0.0), address

    def failed(self, address: str, exc: Unavailable) -> None:
        """A try found the worker unreachable; raises `exc` when the worker itself answered
        UNAVAILABLE (its store is the trouble: another worker would fare no better)."""
        if exc.remote:
            raise exc
        self.router.mark_down(address)
        self.tried.append(address)
        self.last = exc.message

    def succeeded(self, address: str) -> None:
        self.router.mark_up(address)

    def exhausted(self, agent_id: str) -> Unavailable:
        last = f"; the last: {self.last}" if self.last else ""  # a name that does not
        return Unavailable(  # resolve, TLS that does not fit: the CLI reads it, at the end
            f"no worker could be reached for agent {agent_id!r} "
            f"({len(self.tried)} tries over {', '.join(self.router.workers)}){last}"
        )
