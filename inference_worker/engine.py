"""The engine: what the worker does for agents, on the one thread that owns MLX.

RPC handlers hand it work through `submit`; a turn's tokens come back through the job's
event queue. Between jobs, while turns are in flight, the thread runs `step` (nano-vllm's
LLMEngine.step: schedule, run, postprocess). Arrays that leave this thread (blocks for the
store) are evaluated first. This thread never waits for the store: reads happen on the RPC
thread before its work is submitted (inference_worker.front), writes on the persister's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from agentkv import ids
from agentkv.client.store import StoreClient
from agentkv.errors import (
    AgentBusy,
    AgentExists,
    AgentKVError,
    DeadlineExceeded,
    MarkNotFound,
    ServerBusy,
    SystemPromptDiffers,
    TurnTaken,
    Unavailable,
)
from agentkv.ids import AgentId
from inference_worker.agents import Agent, HotTier, agent_exists
from inference_worker.batching import ActiveTurn, Batcher
from inference_worker.chat import ChatFormat
from inference_worker.config import WorkerConfig
from inference_worker.context import extended
from inference_worker.conversation import ChatMessage, ChatState, chain
from inference_worker.freshness import StoreView, is_current
from inference_worker.grammar import Ask, Forms, Grammars
from inference_worker.hot_agents import HotAgents
from inference_worker.metrics import WorkerMetrics
from inference_worker.persistence import Persister, not_committed, turn_not_durable
from inference_worker.restore import Fetched, Restorer
from inference_worker.runtime import Runtime
from inference_worker.scheduler import Request, Scheduler
from inference_worker.turns import TurnJob, UsageEvent

STOPPED = "the worker stopped before the turn of agent {!r} finished; send it again"
UNCHECKED = (
    "but the store, whose copy of the agent may be newer than this worker's, could not be "
    "asked: send it again"
)
TAKEN = (
    "agent {!r} already took the turn {}, whose reply was lost: describe() the agent to see "
    "its context (that turn included) before saying what comes next"
)
NOT_MADE = (
    "agent {!r} was not made: the CreateAgent call making it was cancelled before its system "
    "prompt was prefilled; create it again"
)
NOT_ADDED = (
    "the messages for agent {!r} were not added: the call adding them {} before they were "
    "prefilled; send them again (with the same request_id: none of it was taken)"
)
log = logging.getLogger("agentkv.worker")
CATCH_UP_SECONDS = 2.0  # how often a worker retries writes the store refused


class Engine:
    def __init__(
        self, config: WorkerConfig, runtime: Runtime, store: StoreClient, metrics: WorkerMetrics
    ) -> None:
        """The engine over the model loaded on runtime.mlx, whose thread from now on runs
        the engine's tick after the jobs waiting (a queue full of turns waits for it)."""
        self.config, self.runtime, self.store, self.metrics = config, runtime, store, metrics
        self.model, self.tokenizer = runtime.model, runtime.tokenizer
        self.chat = ChatFormat(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.chat.eos_ids, self.chat.tool_format)
        self.hot = HotTier(config.hot_budget_bytes, metrics)

        self._windowed = any(w is not None for w in runtime.windows)
        self.persister = Persister(
            store, runtime.fingerprint, config.block_tokens, metrics, self._written
        )
        self.scheduler = Scheduler(config)
        self.batcher = Batcher(
            self.model,
            self.chat.eos_ids,
            self.scheduler,
            runtime.quantized_query_max,
            self._turn_done,
            self._turn_failed,
            metrics.batch_size.observe,
            runtime.vocab_size,
        )
        self.restorer = Restorer(config, runtime, store)
        self.agents = HotAgents(self.hot, self.batcher, self.persister)
        # Agents whose creation is prefilling, each with the creates of it that came since
        # (job, system prompt): those are answered once it is made, or failed.
        self._creating: dict[AgentId, list[tuple[TurnJob, str]]] = {}
        self._turn_ids = itertools.count(1)
        self._last_catch_up = time.monotonic()
        runtime.mlx.on_tick = self._tick
        runtime.mlx.tick_first = self.scheduler.full

    # the MLX thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.runtime.mlx.submit(fn, *args)

    def close(self) -> None:
        self.runtime.mlx.close()
        # The MLX thread stops between steps: a turn still in the batch (its stream's client
        # may be gone, or outlasted the drain) ends now with an error of its own, so no RPC
        # thread waits for it and the process exits.
        cut = [(turn.agent.id, turn.job) for turn in list(self.batcher.active.values())]
        cut += [(agent, job) for agent, waiting in self._creating.items() for job, _ in waiting]
        for (_, agent_id), job in cut:
            job.end(error=Unavailable(STOPPED.format(agent_id)))
        agents = {agent: None for agent, _ in cut}  # in order, once each
        if agents:
            log.warning(
                "turns cut by the stop (their calls ended UNAVAILABLE: to be sent again)",
                extra={"agents": len(agents), "first": [a for _, a in list(agents)[:5]]},
            )
        self._finish_writes(set(agents))

    def _finish_writes(self, cut: set[AgentId]) -> None:
        """Finishes queued store writes for up to `stop_write_seconds`; past that (a hung
        store) cuts them, closing the store client: each agent then has its last commit in
        the store, and every durable turn acknowledged is in it (its reply waited for it).
        Says which agents' acknowledged turns are not in the store: not those whose only
        unwritten part is a turn `cut` (its caller was told)."""
        finished = self.persister.close(self.config.stop_write_seconds)
        if not finished:
            self.store.close()  # the write in flight fails now, not at its deadline
        self.persister.join()
        unwritten = [
            a for a in self.hot.unwritten() if a.id not in cut or a.persist_failed or not finished
        ]
        if unwritten:
            log.warning(
                "stopped with turns not in the store",
                extra={
                    "agents": len(unwritten),
                    "cut": not finished,
                    "first": [a.agent_id for a in unwritten[:5]],
                },
            )

    def _tick(self) -> bool:
        """After the jobs waiting ran: a model step while turns are in flight. Every few
        seconds, busy or not, the writes the store refused are retried: a turn may be waiting
        for RAM that only those agents hold until they are durable. Whether turns are in
        flight."""
        if self.batcher.active:
            self.step()
            self.metrics.turns_waiting.set(len(self.scheduler.waiting))
        if time.monotonic() - self._last_catch_up >= CATCH_UP_SECONDS:
            self._last_catch_up = time.monotonic()
            for agent in self.hot.failed_writes(self.batcher.holds):
                self.persister.persist(agent)
        return bool(self.batcher.active)

    def step(self) -> None:
        """One model step: schedule (idle hot agents first make room for a waiting turn),
        run, postprocess. A failed shared step fails every turn in flight, not the worker."""
        if self.scheduler.waiting:  # only admitting a waiting turn reads the hot bytes
            room = self.scheduler.hot_room()
            if room < 0 and self.scheduler.running:  # it waits for the batch, not for them:
                room = self.config.hot_budget_bytes  # idle agents stay until it could run
            self.scheduler.hot_bytes = self.hot.make_room(self.batcher.busy(), room)
            if self.scheduler.hot_bytes > room and not self.scheduler.running:
                time.sleep(0.005)  # nothing can run until a write lands: do not spin
        try:
            step = self.batcher.schedule()
            self.batcher.run(step)
            self.scheduler.complete(step)
        except Exception:
            log.exception("model step failed")
            self.batcher.fail_all()

    # agents (each runs on the MLX thread)

    def create_agent(
        self,
        job: TurnJob,
        system: str,
        metadata: dict[str, str],
        start: tuple[list[int], ChatState],
        shared: Fetched | None = None,
        view: StoreView | None = None,
    ) -> None:
        """Starts a new agent (ids, metadata and system prompt checked by the caller, which
        rendered its stable prefix: `start`, ChatFormat.start's): its system prompt is
        prefilled after the blocks of `shared` (Restorer.fetch_prefix: the same prefix,
        stored) as a turn of its own, scheduled in chunks between the others' steps and
        within the hot budget; its usage and END arrive on job.events.

        A call cancelled (its deadline, or its client gone) before the prefill's last chunk
        ran makes nothing: it leaves the batch at the next step, no agent here or in the
        store. One cancelled later makes the agent whole all the same (in RAM at once, in
        the store once its commit lands): the cancel is read only between steps.

        A RAM copy that `view` (the store's word, asked by the caller) shows is gone from
        the store since it was committed (deleted elsewhere) is dropped, and the agent made
        anew, as a turn would find it gone."""
        self.batcher.let_cancelled_go()  # a retry does not wait on its cancelled first call
        if job.cancelled.is_set():
            raise DeadlineExceeded(NOT_MADE.format(job.agent_id))
        ns, agent_id = job.namespace, job.agent_id
        hot = self.hot.get((ns, agent_id))
        if hot is not None and hot.id in self._creating:  # being made: answered once it is
            self._creating[hot.id].append((job, system))
            return
        if hot is not None and not self.batcher.holds(hot) and not self._current(hot, view):
            self.hot.pop(hot.id)
            hot = None
        if hot is not None:  # the RPC thread asked the store
            self._exists(job, hot, agent_exists(ns, agent_id, hot.metadata, system, job.tools))
            return
        tokens, chat = start
        caches = self.restorer.empty_caches()
        agent = Agent(ns, agent_id, tokens, caches, phase=job.phase, metadata=metadata, chat=chat)
        agent.check_context(0, self.runtime.max_context)
        usage = UsageEvent(prompt_tokens=len(tokens), cache_state="cold")
        if shared is not None and shared.layers:
            usage.reused_store_tokens = self.restorer.seed(agent, shared)
            usage.cache_state, usage.restore_path = "warm", shared.path
            usage.restored_bytes = shared.bytes_read
        pending = tokens[agent.cached :]
        usage.prefilled_tokens = len(pending)
        memory = agent.memory_for(len(tokens), self.runtime.token_bytes)
        turn = self._turn(job, agent, usage, pending, memory)
        turn.request.own_bytes = agent.nbytes  # the shared prefix's blocks, while it waits
        if pending:
            self.batcher.add(turn)  # may refuse: RESOURCE_EXHAUSTED, OUT_OF_RANGE
        else:
            self._room_now(turn)  # may refuse: RESOURCE_EXHAUSTED
        for cache in agent.caches:
            cache.begin_turn()
        self.hot.put(agent)
        self._creating[agent.id] = []
        if not pending:
            turn.usage.finish_reason = "none"
            self._turn_done(turn)

    def _room_now(self, turn: ActiveTurn) -> None:
        """Room for an agent made whole at once from the store's blocks, which no step
        admits: idle agents give way as for a waiting turn, and if they cannot (their
        writes not landed), ServerBusy."""
        room = self.scheduler.room_now(turn.request)
        if self.hot.make_room(self.batcher.busy(), room) > room:
            raise ServerBusy(
                f"worker busy: agent {turn.agent.agent_id!r} holds {turn.request.memory_bytes} "
                "bytes of KV cache from its first moment, more than the memory budget "
                "(--hot-budget) has free until the writes in flight land; retry later"
            )

    def start_turn(
        self, job: TurnJob, view: StoreView | None = None, fetched: Fetched | None = None
    ) -> bool:
        """Prepares a turn and queues it for the batch; its tokens, usage and END arrive on
        job.events. Errors before it is queued are raised; a refused turn leaves the agent
        exactly as it was, so the client may retry. `view` is what the store said of the
        agent (freshness). Returns False, changing nothing, when the agent must first be
        read from the store: the caller fetches it (Restorer.fetch, off this thread) and
        calls again with it.

        One cancelled (its deadline, or its client gone) before its prefill ended leaves the
        agent as it was, an injection's messages and request_id included, so a retry adds
        them once; one cancelled after the last chunk ran is whole (the cancel is read only
        between steps), and a retry of it with that request_id adds nothing."""
        self.batcher.let_cancelled_go()  # a retry does not find its cancelled call mid-turn
        usage = UsageEvent()
        agent = self._checkout(job, usage, view, fetched)
        if agent is None:
            return False
        if _prefetch(job) and not (self.batcher.holds(agent) or usage.restore_failure):
            # In RAM now: nothing to run or write. One whose restore failed goes on as a turn
            # (its context is prefilled again, then written); one mid-turn, or still being
            # made, is refused as any turn is (FAILED_PRECONDITION, "in progress").
            usage.prompt_tokens, usage.finish_reason = len(agent.tokens), "none"
            self.hot.admit(agent, self.batcher.busy())  # within budget, as a turn's end
            job.end(usage)
            return True
        try:
            turn, tokens, chat = self._prepare(job, agent, usage)
        except MarkNotFound as exc:
            if usage.cache_state == "hot" and view is not None and not view.answered:
                # The store's copy, which could not be asked, may be newer than this RAM
                # copy and hold the point (another worker went on): not a NOT_FOUND yet.
                raise Unavailable(f"{exc.message}; {UNCHECKED}") from None
            raise
        if turn.pending:
            self.batcher.add(turn)  # may refuse: RESOURCE_EXHAUSTED, OUT_OF_RANGE
        keep, block_tokens = len(tokens) - len(turn.pending), self.config.block_tokens
        turn.undo = agent.begin_turn(tokens, chat, job.phase, keep, block_tokens)
        if not turn.pending:  # nothing to run: an empty append-only turn ends here
            turn.usage.finish_reason = "none"
            self._turn_done(turn)
        return True

    def _prepare(
        self, job: TurnJob, agent: Agent, usage: UsageEvent
    ) -> tuple[ActiveTurn, list[int], ChatState]:
        """The turn and the agent's new context, computed without changing the agent. A
        retry of the call the agent took last (its request_id) adds nothing; one that asks
        for a reply is refused, as that reply is gone (a whole conversation resent resumes
        from before it, so it runs again without repeating anything)."""
        max_tokens = job.sampling.max_tokens
        if self.batcher.holds(agent):  # first: a retry of that turn learns if it is taken
            raise AgentBusy(f"agent {agent.agent_id!r} already has a turn in progress")
        again = bool(job.request_id) and job.request_id == agent.chat.applied  # a lost reply's
        if again and max_tokens and not (job.whole_conversation or job.after_mark):
            raise TurnTaken(TAKEN.format(agent.agent_id, job.request_id))
        start, tokens, chat = extended(self.chat, job, agent, again)
        if job.request_id:
            chat = replace(chat, applied=job.request_id)
        held = agent.memory_for(len(tokens), self.runtime.token_bytes)  # its own, prefilled
        if job.sampling.fit_max_tokens and max_tokens:  # at least 1: a full context is refused
            room = self.runtime.max_context - len(tokens)
            # alone in the batch: its context there and its own, and the tokens it makes
            budget = (self.config.hot_budget_bytes - 2 * held) // max(1, self.runtime.token_bytes)
            max_tokens = job.sampling.max_tokens = max(1, min(max_tokens, room, budget))
        agent.check_context(len(tokens) - len(agent.tokens) + max_tokens, self.runtime.max_context)
        reuse = agent.reusable(tokens, max_tokens > 0, usage, start.cached, start.prefix)
        pending = tokens[reuse:]
        usage.prompt_tokens, usage.prefilled_tokens = len(tokens), len(pending)
        memory = agent.memory_for(len(tokens) + max_tokens, self.runtime.token_bytes)
        waited = time.perf_counter() - job.started  # on the store, a restore: it counts
        deadline = time.monotonic() - waited + job.deadline_ms / 1000 if job.deadline_ms else None
        turn = self._turn(job, agent, usage, pending, memory, deadline)
        turn.request.own_bytes = held
        if job.sampling.fit_max_tokens and max_tokens:  # a ceiling, lowered at admission
            turn.request.token_bytes = self.runtime.token_bytes
        turn.own_turn = start.prefix - reuse if reuse < start.prefix else 0
        forms = self._forms(job, chat.tools) if max_tokens else job.forms
        ask = forms.ask if forms is not None else Ask()
        calls = self.chat.reply_calls(chat.tools, job.max_tool_calls, ask.allowed)
        turn.calls = calls if max_tokens and not ask.forbidden else None  # spelled calls: text
        if forms is not None and max_tokens:
            turn.constraint = forms.constraint(chat.tools, agent.agent_id)
        return turn, tokens, chat

    def _forms(self, job: TurnJob, tools: str) -> Forms | None:
        """The reply's forms: compiled at submit, or settled now where the turn sent no tools
        and its agent's own apply (known only now), so that strict ones among them hold its
        calls as a request's strict tools do (Grammars.settled)."""
        if not job.own_tools or not tools:
            return job.forms
        return self.grammars.settled(job.forms, tools)

    def _turn(
        self,
        job: TurnJob,
        agent: Agent,
        usage: UsageEvent,
        pending: list[int],
        memory: int,
        deadline: float | None = None,
    ) -> ActiveTurn:
        """The batch's turn for `job`: it prefills `pending` and asks for `memory` bytes."""
        max_tokens = job.sampling.max_tokens
        rid = f"{next(self._turn_ids)}"
        request = Request(
            rid, len(pending), max_tokens, memory, job.priority, deadline, job.namespace
        )
        return ActiveTurn(job, agent, usage, request, pending, self.tokenizer.detokenizer)

    def _turn_failed(self, turn: ActiveTurn, error: AgentKVError, scope: str) -> None:
        """A turn failed after it was queued: its agent goes back to before it (so a retry
        does not say its messages twice), and its stream ends with `error`, its own."""
        agent = turn.agent
        if turn.job.creates:
            self.hot.pop(agent.id)  # a new agent whose prefill failed: it never was
            for waiting, _ in self._creating.pop(agent.id, []):
                waiting.end(error=error)
        elif turn.undo is not None and not turn.undo.restore(agent):
            self.hot.pop(agent.id)  # its caches cannot be rewound: the store's copy is right
            log.warning(
                "agent dropped from RAM after a failed turn", extra={"agent": agent.agent_id}
            )
        self.metrics.turn_failures.labels(scope=scope).inc()
        turn.job.end(error=error)

    def _exists(self, job: TurnJob, agent: Agent, exists: AgentExists) -> None:
        """Ends a CreateAgent of an agent made already with `exists`: a durable one once the
        agent is in the store (its write in flight lands), else with what kept it out (an
        SDK takes AgentExists for "made", and a durable caller for "stored")."""
        if not job.durable or agent.durable or isinstance(exists, SystemPromptDiffers):
            job.end(error=exists)
        elif agent.pending is not None and not agent.pending.done():
            agent.pending.add_done_callback(
                lambda write: job.end(error=turn_not_durable(agent, write.result()) or exists)
            )
        else:
            job.end(error=not_committed(agent, agent.persist_error, "the agent was made, but"))

    def _turn_done(self, turn: ActiveTurn) -> None:
        """A turn left the batch: persist the agent, then end its stream (a durable turn's
        once its commit is done, on the writer thread)."""
        usage, agent, job = turn.usage, turn.agent, turn.job
        cut = usage.finish_reason in ("cancelled", "deadline")
        unseen = job.cancelled.is_set() and not job.streamed  # its caller left with nothing
        if (cut and not usage.generated_tokens) or (unseen and usage.generated_tokens):
            # Cut before its prefill ended (one that ends leaves with a token, or with "none"
            # when it asks for none): it goes back as a failed turn does, or its messages
            # would stay in the context over a cache that holds part of them, with no reply.
            # So does one whose caller left before a token of it was sent (the step that
            # ends a prefill samples the first token, and may end a short reply): its
            # caller was told it failed.
            scope = usage.finish_reason if cut else "cancelled"  # its caller left
            self._turn_failed(turn, _ended_early(turn), scope)
            return
        calls: tuple[str, ...] = ()  # the reply's, for the tool results after its mark
        if usage.generated_tokens:
            reply = _reply(turn)
            calls = tuple(call.id for call in reply.tool_calls)
            chat = agent.chat
            chat.reply_open, chat.last_role = True, "assistant"
            chat.digest = chain(chat.digest, [reply])
            self.metrics.generated_tokens.inc(usage.generated_tokens)
            self.metrics.ttft.observe(usage.time_to_first_token_ms / 1000)
        if usage.generated_tokens or job.messages:
            agent.chat = agent.chat.marked(len(agent.tokens), agent.cached, job.mark_name, calls)
            usage.mark = agent.chat.digest
        self._finish_turn(agent)
        if job.creates:
            for waiting, system in self._creating.pop(agent.id, []):
                exists = agent_exists(
                    agent.namespace, agent.agent_id, agent.metadata, system, waiting.tools
                )
                self._exists(waiting, agent, exists)
        else:
            self.metrics.turns.labels(state=usage.cache_state).inc()
        if job.durable and agent.pending is not None:
            agent.pending.add_done_callback(
                lambda write: job.end(usage, turn_not_durable(agent, write.result()))
            )
        else:
            job.end(usage)

    # turn steps

    def _checkout(
        self, job: TurnJob, usage: UsageEvent, view: StoreView | None, fetched: Fetched | None
    ) -> Agent | None:
        """The agent in RAM if that copy is current, or mid-turn here (the turn is then
        refused, AgentBusy, by _prepare, which every caller runs next), else restored from
        `fetched`; None when it must be fetched first."""
        agent = self.hot.get((ids.namespace(job.namespace), ids.agent_id(job.agent_id)))
        held = agent is not None and self.batcher.holds(agent)  # mid-turn: busy, not dropped
        if agent is not None and not held and not self._current(agent, view):
            self.hot.pop(agent.id)
            agent = None
        if agent is not None:
            usage.cache_state, usage.reused_hot_tokens = "hot", agent.cached
            return agent
        if fetched is None:
            return None
        restored = self.restorer.build(fetched)
        restored.fill(usage)
        if restored.failure:
            self.metrics.restore_failures.inc()
        self.hot.put(restored.agent)
        return restored.agent

    def _current(self, agent: Agent, view: StoreView | None) -> bool:
        """Whether the agent's RAM copy is its latest state, by the store's `view`."""
        return not agent.stale and is_current(agent, view, self.persister.adopt_own_commit)

    def _finish_turn(self, agent: Agent) -> None:
        """Queues the store write, then keeps the hot tier within budget."""
        for cache in agent.caches:
            cache.end_turn()  # the next turn sees what is stored, as a restored agent does
        self.persister.persist(agent)
        self.hot.admit(agent, self.batcher.busy())

    def _written(self, agent: Agent) -> None:
        """After each store write (on the writer thread): window caches may let go."""
        if self._windowed:
            self.submit(self.hot.release, agent, self.batcher.holds)


def _reply(turn: ActiveTurn) -> ChatMessage:
    """What the context holds of a reply: the text sent, and past a stop string the text the
    caller never saw (so a resend of the cut reply matches no mark from here on); its tool
    calls apart from its text."""
    if turn.calls is None:
        return ChatMessage("assistant", turn.stops.text)
    unsent = turn.stops.text[turn.stops.sent :]
    return ChatMessage("assistant", turn.calls.text + unsent, tuple(turn.calls.calls))


def _prefetch(job: TurnJob) -> bool:
    """A turn that adds nothing and asks for nothing: the SDK's prefetch."""
    return not (job.messages or job.sampling.max_tokens or job.whole_conversation)


def _ended_early(turn: ActiveTurn) -> DeadlineExceeded:
    """What a turn that left the batch before its prefill ended raises, or one whose caller
    left before any of its reply was sent."""
    agent_id = turn.agent.agent_id
    if turn.job.creates:
        return DeadlineExceeded(NOT_MADE.format(agent_id))
    why = "ran out of time" if turn.usage.finish_reason == "deadline" else "was cancelled"
    if not turn.job.sampling.max_tokens:
        return DeadlineExceeded(NOT_ADDED.format(agent_id, why))
    if turn.usage.generated_tokens:  # its caller left before any of them reached it
        return DeadlineExceeded(f"the turn of agent {agent_id!r} {why} before it replied")
    return DeadlineExceeded(f"the turn of agent {agent_id!r} {why} before its first token")
