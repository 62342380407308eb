"""Multi-phase workflows: permanent agents carry their caches across phases, and what they
missed between phases is injected into their caches, never recomputed.

    flow = Workflow(mem, [Role("warden", WARDEN), Role("a", PRISONER_A), Role("b", PRISONER_B)])
    with flow.phase("interrogation", brief="The warden questions each prisoner.") as phase:
        phase.say("warden", "Ask prisoner A where he was.")
        phase.say("a", "Answer the warden.")

Who hears whom: a role hears every other role's replies unless its `hears` names the roles it
hears. When a phase starts, each permanent agent that exists gets one injected message with
the phase's brief and the replies it heard since it last spoke or was injected. A turn sends
what the speaker heard since then together with its prompt. Ephemeral roles exist for one
phase: created with the transcript they hear, deleted when the phase ends.

Mode "cold" is the baseline the paper compares against: every phase starts from nothing, so
each agent's first turn in a phase re-prefills its whole history as messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.client.memory import Agent, AgentMemory
from agentkv.errors import InvalidArgument

MODES = ("persistent", "cold")


@dataclass(frozen=True, slots=True)
class Role:
    id: str
    system: str
    permanent: bool = True
    hears: tuple[str, ...] | None = None  # None: every other role
    document: str = ""  # sent ahead of its first turn's message (priming)


@dataclass(frozen=True, slots=True)
class Said:
    phase: str
    speaker: str  # "": the phase's brief, which every role hears
    text: str  # a brief taken back (its phase failed to start): ""


@dataclass(slots=True)
class Record:
    """One thing the workflow did to an agent: "create" (its system prompt prefilled), "say"
    (a turn) or "inject" (what it missed, appended)."""

    kind: str
    phase: str
    agent: str
    cache_state: str  # where its cache was: hot, warm, or cold (also: created for this turn)
    ms: float  # a turn: time to first token; create and inject: the whole call
    prefilled_tokens: int
    context_tokens: int
    generated_tokens: int = 0
    worker: str = ""
    text: str = ""


@dataclass(slots=True)
class _Member:
    role: Role
    agent: Agent | None = None  # None until created (or after a cold phase reset)
    heard: int = 0  # transcript entries before this index were delivered (or its own)
    primed: bool = False  # its agent has had a first turn (what only a first turn carries)
    history: list[tuple[str, str]] = field(default_factory=list)  # messages, for cold mode


class Workflow:
    def __init__(
        self,
        memory: AgentMemory,
        roles: Sequence[Role],
        *,
        mode: str = "persistent",
        sampling: dict[str, Any] | None = None,
        on_record: Callable[[Record], None] | None = None,
    ) -> None:
        if mode not in MODES:
            raise InvalidArgument(f"mode {mode!r} is not one of {', '.join(MODES)}")
        ids = [r.id for r in roles]
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"role ids repeat: {ids}")
        for role in roles:
            for heard in role.hears or ():
                if heard not in ids:
                    raise InvalidArgument(f"role {role.id!r} hears {heard!r}, which is no role")
        self.memory, self.mode = memory, mode
        self.sampling = {"max_tokens": 64, **(sampling or {})}
        self.members = {r.id: _Member(r) for r in roles}
        self.transcript: list[Said] = []
        self.records: list[Record] = []
        self.on_record = on_record or (lambda record: None)
        self.current: Phase | None = None

    def phase(self, name: str, brief: str = "", *, evict_after: bool = False) -> Phase:
        """A phase; `evict_after` evicts every agent to the store when it ends (as memory
        pressure would), so the next phase finds them warm."""
        return Phase(self, name, brief, evict_after)

    def member(self, agent_id: str) -> _Member:
        member = self.members.get(agent_id)
        if member is None:
            raise InvalidArgument(
                f"agent {agent_id!r} is not in the workflow (roles: {', '.join(self.members)})"
            )
        return member

    # phases

    def _begin(self, phase: Phase) -> None:
        """Briefs every member (the brief joins the transcript) and injects (or, cold, drops)
        each permanent agent. A start that fails leaves no phase open and takes the brief
        back from every member that has not had it yet (the injections that went through
        keep theirs)."""
        if self.current is not None:
            raise InvalidArgument(f"phase {phase.name!r} starts inside {self.current.name!r}")
        self.current = phase
        brief = len(self.transcript)
        if phase.brief:
            self.transcript.append(Said(phase.name, "", phase.brief))
        try:
            for member in self.members.values():
                if member.agent is None or not member.role.permanent:
                    continue  # created at their first turn, with everything they heard
                if self.mode == "cold":
                    self._reset(member)
                else:
                    self._inject(member, phase.name)
        except BaseException:
            self.current = None
            if phase.brief:  # kept in its place: the transcript's indices stay as delivered
                self.transcript[brief] = Said(phase.name, "", "")
            raise

    def _end(self, phase: Phase, failed: bool) -> None:
        """Deletes the phase's ephemeral agents and, with `evict_after`, evicts the rest. The
        workflow leaves the phase, and tries every delete and eviction, even when one fails;
        the first failure is raised, unless the phase `failed`: its own error stands."""
        self.current = None
        dropped = []
        for member in phase.ephemeral:
            dropped.append(member.agent)
            member.agent, member.primed, member.heard, member.history = None, False, 0, []
        calls = [agent.delete for agent in dropped if agent is not None]
        if phase.evict_after:
            calls += [m.agent.evict for m in self.members.values() if m.agent is not None]
        errors = []
        for call in calls:
            try:
                call()
            except Exception as exc:  # the others still run; the first is raised below
                errors.append(exc)
        if errors and not failed:
            raise errors[0]

    def _reset(self, member: _Member) -> None:
        """Cold mode: the agent's caches are dropped; its next turn re-prefills its history."""
        if member.agent is not None:
            member.agent.delete()
            member.agent, member.primed = None, False

    # turns

    def say(self, agent_id: str, prompt: str, **sampling: Any) -> Record:
        phase = self.current
        if phase is None:
            raise InvalidArgument("say() runs inside a phase: with workflow.phase(name): ...")
        member = self.member(agent_id)
        if not prompt.strip():
            raise InvalidArgument(f"the prompt for {agent_id!r} in phase {phase.name!r} is empty")
        news, delivered = self._news(member)
        message = "\n\n".join([*news, prompt]) if news else prompt
        messages = [("user", message)]
        if member.agent is None:
            if not member.role.permanent:  # first: a create that fails half-way is cleaned up
                phase.ephemeral.append(member)
            self._create(member, phase.name)
        first = not member.primed  # also the retry of a first turn that failed
        if first:
            if member.agent.created and not member.history and member.role.document:
                # an agent that already existed (`agentkv run --no-reset`) holds it already
                message = f"{member.role.document}\n\n{message}"
            messages = [*self._carried(member), ("user", message)]
        reply = member.agent.say(messages, phase=phase.name, **{**self.sampling, **sampling})
        text = reply.text
        usage = reply.usage
        delivered()
        member.primed = True
        # An agent made for its first turn had no cache for what the turn prefills: it is
        # cold, though the worker finds the empty agent (or its system prompt) hot. One that
        # already existed (a rerun, `agentkv run --no-reset`) is labelled as the worker found it.
        state = "cold" if first and member.agent.created else usage.cache_state
        member.history += [("user", message), ("assistant", text or "...")]
        # Its own reply needs no marking as heard (_news skips a member's own lines); another
        # agent's reply that landed during this turn, from another thread, is still news.
        self.transcript.append(Said(phase.name, agent_id, text))
        return self._record(
            Record(
                "say",
                phase.name,
                agent_id,
                state,
                usage.time_to_first_token_ms,
                usage.prefilled_tokens,
                usage.prompt_tokens,
                usage.generated_tokens,
                reply.worker,
                text,
            )
        )

    def _create(self, member: _Member, phase: str) -> None:
        """Creates the member's agent. Persistent mode prefills the system prompt now (a cold
        prefill, recorded); cold mode sends it with the first turn (`_carried`)."""
        role, cold = member.role, self.mode == "cold"
        started = time.perf_counter()
        system = "" if cold else role.system
        member.agent = self.memory.agent(role.id, system, phase=phase)
        if not role.permanent and not member.agent.created:
            # Left over from a phase whose cleanup failed: an ephemeral agent starts empty.
            member.agent.delete()
            member.agent = self.memory.agent(role.id, system, phase=phase)
        state = member.agent.state
        if member.agent.created and state is not None:
            ms = (time.perf_counter() - started) * 1000
            self._record(
                Record("create", phase, role.id, "cold", ms, state.num_tokens, state.num_tokens)
            )

    def _carried(self, member: _Member) -> list[tuple[str, str]]:
        """The messages an agent's first turn carries ahead of its message: in cold mode the
        system prompt and the whole history, so that its time to first token counts the full
        re-prefill."""
        if self.mode != "cold":
            return []
        system = [("system", member.role.system)] if member.role.system else []
        return [*system, *member.history]

    def _inject(self, member: _Member, phase: str) -> None:
        news, delivered = self._news(member)
        if not news:
            return
        message = "\n\n".join(news)
        started = time.perf_counter()
        result = member.agent.inject(message, phase=phase)
        delivered()
        member.history.append(("user", message))
        self._record(
            Record(
                "inject",
                phase,
                member.role.id,
                result.usage.cache_state,
                (time.perf_counter() - started) * 1000,
                result.usage.prefilled_tokens,
                result.agent.num_tokens,
            )
        )

    def _news(self, member: _Member) -> tuple[list[str], Callable[[], None]]:
        """Briefs and heard replies not yet delivered to the member, in the order they came,
        and what marks them delivered, once the turn that carries them has gone through (a
        failed one keeps them for the next)."""
        upto = len(self.transcript)  # first: other threads may append while this reads
        news = [self._told(said, member.role) for said in self.transcript[member.heard : upto]]

        def delivered() -> None:
            member.heard = max(member.heard, upto)

        return [told for told in news if told], delivered

    @staticmethod
    def _told(said: Said, role: Role) -> str:
        """What `role` hears of `said`: a brief whole, another's reply it hears quoted."""
        if not said.speaker:
            return said.text
        if said.speaker == role.id or (role.hears is not None and said.speaker not in role.hears):
            return ""
        return f'{said.speaker.capitalize()} said: "{said.text.strip()}"'

    def _record(self, record: Record) -> Record:
        self.records.append(record)
        self.on_record(record)
        return record


class Phase:
    def __init__(self, workflow: Workflow, name: str, brief: str, evict_after: bool) -> None:
        if not name.strip():
            raise InvalidArgument("a phase needs a name")
        self.workflow, self.name, self.brief = workflow, name, brief
        self.evict_after = evict_after
        self.ephemeral: list[_Member] = []

    def __enter__(self) -> Phase:
        self.workflow._begin(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.workflow._end(self, failed=kind is not None)

    def say(self, agent_id: str, prompt: str, **sampling: Any) -> Record:
        return self.workflow.say(agent_id, prompt, **sampling)
