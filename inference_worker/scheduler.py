"""Which requests run in the next model step: continuous batching in plain Python (no MLX).

Each step spends a token budget. Every running request that is decoding gets its one token
first, so streams stay smooth; what is left goes to prefill chunks, oldest first within the
highest priority, so a long prefill is cut into pieces instead of freezing the others. New
requests join between any two steps, while memory (hot tier + live batch) and the batch size
allow; the rest wait in a bounded queue, and past it a request is refused at once. A waiting
request's agent is in RAM already (restored, or hot), so the queue is bounded in bytes too:
the agents waiting, and the most any one of them claims on top once admitted, fit the
budget. Admission counts them, so the budget covers every agent with a turn in flight, and
the first in line is admitted at the latest once the batch empties.
Namespaces (tenants) are served in turn: the line takes every namespace's first request,
then every one's second, ...; priority orders a namespace's own requests. One namespace may
fill the whole queue, but a full queue is shared: a newcomer of a namespace holding fewer of
its places takes the place of the last in line of the namespace holding the most. So no
tenant's flood (or priority) holds the others' place in line. A running turn is not paused
for another, so the batch keeps a slot: while another namespace had a turn within the last
SHARED_SECONDS, no namespace takes the last slot of --max-batch, and a turn of another
starts at the next step (a lone tenant still takes them all).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from agentkv.errors import OverBudget, ServerBusy
from inference_worker.config import WorkerConfig

SHARED_SECONDS = 60.0  # how long a namespace's last turn keeps a batch slot from another's


class State(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


_ORDER = itertools.count()


@dataclass(slots=True)
class Request:
    """A turn as the scheduler sees it: token counts, a memory claim, and when it must end."""

    request_id: str
    prompt_tokens: int  # tokens still to prefill when it starts
    max_tokens: int
    memory_bytes: int  # KV bytes its context holds at its longest (with max_tokens)
    priority: int = 0  # higher runs first
    deadline: float | None = None  # on the scheduler's clock; past it the request expires
    namespace: str = ""  # the tenant: namespaces take turns in line
    round: int = 0  # its turn in line among the namespaces' (Scheduler._line)
    state: State = State.WAITING
    prefilled: int = 0
    generated: int = 0
    order: int = field(default_factory=lambda: next(_ORDER))  # arrival order, for FCFS
    # KV bytes its agent's own caches hold meanwhile (its context once prefilled): a turn
    # that decodes has its context copied into the live batch, and keeps them to be undone
    own_bytes: int = 0
    # KV bytes each of its max_tokens adds, when max_tokens is a ceiling (fit_max_tokens):
    # admitted alone, it is lowered to what the budget holds beside the agents still
    # waiting, down to one token. 0: max_tokens as asked.
    token_bytes: int = 0

    @property
    def done(self) -> bool:
        return self.state in (State.FINISHED, State.CANCELLED, State.EXPIRED)


@dataclass(slots=True)
class Step:
    """One model step: decode one token for each of `decode`, prefill `prefill` chunks."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)
    admitted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, config: WorkerConfig, prefill_while_decoding: int = 128) -> None:
        self.max_batch, self.prefill_chunk = config.max_batch, config.prefill_chunk
        self.step_tokens = max(config.step_tokens, config.max_batch)  # room for every decoder
        self.queue_limit, self.memory_budget = config.queue_limit, config.hot_budget_bytes
        # While anyone decodes, a step prefills at most this much: it bounds their token gap.
        self.prefill_while_decoding = prefill_while_decoding
        self.hot_bytes = 0  # set by the engine: RAM its hot tier holds outside the batch
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._round = 0  # the round of the request admitted last
        self._next: dict[str, int] = {}  # namespace -> the round it may be served in next
        self._active: dict[str, float] = {}  # namespace -> when it last had a turn here

    # requests in and out

    def submit(self, request: Request) -> Request | None:
        """Queues a request; returns the one it pushed out of a full queue, if any (the last
        in line of the namespace holding the most places, when the request's own namespace
        holds at least two fewer). Raises OverBudget for one that could never run here (not
        retried: it never would), ServerBusy for one that may not wait."""
        if (need := claim([request])) > self.memory_budget:
            what, fewer = "its context", "a shorter context"  # a new agent's prefix, say
            if request.max_tokens:
                what, fewer = "its context and max_tokens", "fewer tokens or a shorter context"
            undo = request.own_bytes and request.max_tokens  # a turn that joins the batch
            twice = ", and its context again to undo the turn" if undo else ""
            raise OverBudget(
                f"the turn needs {need} bytes of KV cache ({what}){twice}, more than "
                f"this worker's whole memory budget of {self.memory_budget} (--hot-budget): "
                f"ask for {fewer}"
            )
        pushed = None
        if len(self.waiting) >= self.queue_limit or not self._fits([*self.waiting, request]):
            pushed = self._pushed_out(request)
            self.waiting.remove(pushed)
            pushed.state = State.CANCELLED
        self.waiting.append(request)
        return pushed

    def full(self) -> bool:
        """Whether the queue is full for the next request, by count or by bytes (a step may
        admit some)."""
        return len(self.waiting) >= self.queue_limit or queued(self.waiting) >= self.memory_budget

    def _fits(self, line: list[Request]) -> bool:
        return queued(line) <= self.memory_budget

    def _pushed_out(self, request: Request) -> Request:
        """Whose place in a full queue `request` takes, or ServerBusy."""
        namespace = request.namespace
        held = Counter(r.namespace for r in self.waiting)
        most, count = held.most_common(1)[0] if held else ("", 0)
        full = len(self.waiting) >= self.queue_limit
        if held[namespace] + 1 >= count:  # it would hold as many: it waits its turn elsewhere
            if not full:
                raise self._no_room(request)
            raise ServerBusy(
                f"worker busy: {len(self.running)} running, {len(self.waiting)} queued "
                f"(queue limit {self.queue_limit}; namespace {namespace!r} holds "
                f"{held[namespace]} of those places, no fewer than any other); retry later"
            )
        pushed = [r for r in self._line() if r.namespace == most][-1]
        if not self._fits([r for r in self.waiting if r is not pushed] + [request]):
            raise self._no_room(request)
        return pushed

    def _no_room(self, request: Request) -> ServerBusy:
        need = queued([*self.waiting, request])
        return ServerBusy(
            f"worker busy: the {len(self.waiting)} turns queued hold {self.waiting_bytes} "
            f"bytes of KV cache; with this turn ({request.own_bytes} held, {least(request)} "
            f"once running) the queue would need {need} bytes, the agents waiting and the most "
            f"one of them claims running, past the memory budget of {self.memory_budget} "
            "(--hot-budget); retry later"
        )

    def cancel(self, request_id: str) -> Request | None:
        """Stops a request now; its slot and memory are free for the next step."""
        for pool in (self.running, self.waiting):
            for request in pool:
                if request.request_id == request_id:
                    pool.remove(request)
                    request.state = State.CANCELLED
                    return request
        return None

    def finish(self, request: Request) -> None:
        """The engine saw EOS, a stop string or max_tokens: the request leaves the batch."""
        if request in self.running:
            self.running.remove(request)
        request.state = State.FINISHED

    @property
    def reserved_bytes(self) -> int:
        return claim(self.running)

    @property
    def waiting_bytes(self) -> int:
        """What the agents of the requests waiting hold in RAM meanwhile."""
        return sum(r.own_bytes for r in self.waiting)

    def hot_room(self) -> int:
        """The most hot-tier bytes with which the first waiting request in line is admitted:
        admission serves the line in order, so room for a smaller one behind admits no one."""
        head = self._line()[0]
        behind = self.waiting_bytes - head.own_bytes
        return self.memory_budget - claim([*self.running, head]) - behind

    def room_now(self, request: Request) -> int:
        """The most idle agents may hold for `request` to run now beside the batch and the
        agents waiting: a request that takes no step (an agent made whole at once)."""
        return self.memory_budget - claim([*self.running, request]) - self.waiting_bytes

    # one step

    def schedule(self, now: float) -> Step:
        step = Step(expired=self._expire(now))
        for request in self.waiting + self.running:
            self._active[request.namespace] = now
        self._active = {ns: t for ns, t in self._active.items() if now - t <= SHARED_SECONDS}
        step.admitted = self._admit()
        budget = self.step_tokens
        in_line = _interleaved(self.running)
        for request in in_line:
            if request.state is State.DECODING and budget > 0:
                step.decode.append(request)
                budget -= 1
        if step.decode:
            budget = min(budget, self.prefill_while_decoding)
        for request in in_line:
            if request.state is State.PREFILLING and budget > 0:
                n = min(self.prefill_chunk, budget, request.prompt_tokens - request.prefilled)
                step.prefill.append((request, n))
                budget -= n
        return step

    def complete(self, step: Step) -> None:
        """Records what a step did: prefill progress, and one more token per decoder."""
        for request, n in step.prefill:
            request.prefilled += n
            if request.prefilled >= request.prompt_tokens:
                request.state = State.DECODING
                if request.max_tokens == 0:
                    self.finish(request)  # an append-only turn ends with its prefill
                else:
                    request.generated += 1  # the last chunk's logits give the first token
        for request in step.decode:
            request.generated += 1
        for request in list(self.running):
            if request.generated >= request.max_tokens and request.state is State.DECODING:
                self.finish(request)

    def _admit(self) -> list[Request]:
        admitted = []
        behind = self.waiting_bytes  # the agents still waiting hold these
        for request in self._line():
            if len(self.running) >= self.max_batch:
                break
            if self._last_slot_kept(request):
                continue  # another namespace's turn behind it may take it
            behind -= request.own_bytes
            room = self.memory_budget - self.hot_bytes - behind
            if not self.running:  # alone: a ceiling comes down to what the budget holds
                _lower(request, room + self.hot_bytes)  # once idle agents gave way
            if claim([*self.running, request]) > room:
                break  # first come, first served: no one overtakes the head for memory
            self.waiting.remove(request)
            self._served(request)
            request.state = State.PREFILLING if request.prompt_tokens else State.DECODING
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _last_slot_kept(self, request: Request) -> bool:
        """Whether `request` would give its namespace every batch slot while another
        namespace was active lately: a turn of that one, coming, would wait for a whole
        turn of this one (the red team's 16.5 s behind eight 1,500-token turns)."""
        mine = sum(r.namespace == request.namespace for r in self.running)
        if self.max_batch < 2 or mine < self.max_batch - 1:
            return False
        return any(ns != request.namespace for ns in self._active)

    def _expire(self, now: float) -> list[Request]:
        expired = [
            r for r in self.waiting + self.running if r.deadline is not None and now > r.deadline
        ]
        for request in expired:
            (self.waiting if request in self.waiting else self.running).remove(request)
            request.state = State.EXPIRED
        return expired

    def _line(self) -> list[Request]:
        """The waiting requests in the order they are admitted. Each namespace's own, by
        priority then arrival, take the rounds from the next one it may be served in (one
        past its last admitted; a namespace back from idle starts at the current round, with
        no credit for the time it was away); within a round, priority then arrival."""
        for namespace, line in _by_namespace(self.waiting).items():
            start = max(self._round, self._next.get(namespace, 0))
            for i, request in enumerate(line):
                request.round = start + i
        return sorted(self.waiting, key=_in_round)

    def _served(self, request: Request) -> None:
        """Moves the rounds on past an admitted request (forgetting namespaces that are
        no further on than the current round: they start there anyway)."""
        self._round = max(self._round, request.round)
        self._next[request.namespace] = request.round + 1
        self._next = {ns: n for ns, n in self._next.items() if n > self._round}


def claim(requests: list[Request]) -> int:
    """KV bytes `requests` hold at their longest, running together: the live batch, whose
    rows are each as long as its longest (left-padded to it), and each agent's own caches
    beside it. A turn that asks for no tokens never joins the batch: its own caches alone."""
    rows = [r.memory_bytes for r in requests if r.max_tokens]
    alone = sum(r.memory_bytes for r in requests if not r.max_tokens)
    own = sum(r.own_bytes for r in requests if r.max_tokens)
    return alone + own + len(rows) * max(rows, default=0)


def queued(requests: list[Request]) -> int:
    """The bytes a queue of `requests` asks the budget for: what their agents hold while they
    wait, and the most any one claims on top once admitted (a ceiling's least). While it
    fits the budget, the first in line fits beside the others once the batch is empty and
    idle agents gave way."""
    extra = max((least(r) - r.own_bytes for r in requests), default=0)
    return sum(r.own_bytes for r in requests) + extra


def least(request: Request) -> int:
    """The least a request claims alone: its claim, or with a ceiling, at one token."""
    cut = max(0, request.max_tokens - 1) * request.token_bytes
    return claim([request]) - cut


def _lower(request: Request, room: int) -> None:
    """Lowers a ceiling's max_tokens until the request alone claims at most `room`, or to
    one token (a queue within its bound leaves room for that)."""
    over = claim([request]) - room
    if request.token_bytes and request.max_tokens > 1 and over > 0:
        cut = min(request.max_tokens - 1, -(-over // request.token_bytes))
        request.max_tokens -= cut
        request.memory_bytes -= cut * request.token_bytes


def _in_round(request: Request) -> tuple[int, int, int]:
    return request.round, -request.priority, request.order


def _by_namespace(requests: Iterable[Request]) -> dict[str, list[Request]]:
    """Each namespace's requests, by priority then arrival."""
    mine: dict[str, list[Request]] = defaultdict(list)
    for request in sorted(requests, key=lambda r: (-r.priority, r.order)):
        mine[request.namespace].append(request)
    return mine


def _interleaved(requests: Iterable[Request]) -> list[Request]:
    """Every namespace's first (by priority, then arrival), then every one's second, ...;
    within each, priority then arrival. One namespace: priority, then arrival."""
    rank = {id(r): i for line in _by_namespace(requests).values() for i, r in enumerate(line)}
    return sorted(requests, key=lambda r: (rank[id(r)], -r.priority, r.order))
