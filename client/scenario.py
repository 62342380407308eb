"""Workflow scenarios written in YAML: roles, phases and turns, checked before anything runs.

    name: prisoners_dilemma
    namespace: prisoners            # optional; defaults to the name
    sampling: {max_tokens: 48}      # optional; any SamplingParams field
    agents:
      - id: warden
        system: You are the warden.
        permanent: true             # optional; false makes it live for one phase
        hears: [a, b]               # optional; default: everyone
        document: {module: json, chars: 14000}   # optional priming text (see below)
    phases:
      - name: arrest
        brief: Two prisoners are arrested.   # optional; injected into every agent
        evict_after: false                   # optional; evict every agent at the end
        turns:
          - {agent: warden, say: Tell the prisoners why they are here.}

A `document` is text an agent sees ahead of its first message: `{text: ...}`, or
`{module: NAME, chars: N}` for the first N characters of a Python standard-library module's
source as this interpreter ships it (PSF License; read at run time, nothing copied).
Every error names the file and the place in it. A file is at most 1 MiB, and as much with
its aliases (*name) written out; its documents are 1 Mi characters at most in all; it gives
each key once; a max_tokens is at most 2^21, as many as an agent holds with its context in a
store at its defaults.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.client.memory import AgentMemory
from agentkv.client.scenario_yaml import Checker, ScenarioError, read_yaml, shown
from agentkv.client.workflow import Record, Role, Workflow
from agentkv.errors import AgentKVError, OutOfRange
from agentkv.ids import (
    MAX_PHASE,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    NAMESPACE_RE,
)

__all__ = [
    "PhaseSpec",
    "Scenario",
    "ScenarioError",
    "Turn",
    "check_fits",
    "load_scenario",
    "parse_scenario",
    "run_scenario",
]
SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed"}
# As many tokens as an agent holds, its context included, in a store at its defaults (its
# max_agent_tokens): a turn asking more is absurd whatever the model, whose context the
# scenario cannot know (a worker refuses a turn past it).
MAX_TOKENS = 1 << 21
MAX_DOCUMENTS = 1 << 20  # characters, every agent's document together (a module's is read
# anew for each agent that names it: a 1 MiB file naming one 15,000 times asked for 23 GB)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True, slots=True)
class Turn:
    agent: str
    say: str
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PhaseSpec:
    name: str
    brief: str
    turns: tuple[Turn, ...]
    evict_after: bool = False


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    namespace: str
    description: str
    roles: tuple[Role, ...]
    phases: tuple[PhaseSpec, ...]
    sampling: dict[str, Any]


def load_scenario(
    path: str | Path, document_chars: int | None = None, namespace: str = ""
) -> Scenario:
    """Reads and checks a scenario file. `document_chars` caps every module document (tests
    run the shipped scenarios on tiny models with short contexts); `namespace`, given, is
    the one it runs in, whatever the file says (`agentkv run -n`)."""
    path = Path(path)
    return parse_scenario(read_yaml(path), str(path), document_chars, namespace)


def parse_scenario(
    data: Any, source: str = "scenario", document_chars: int | None = None, namespace: str = ""
) -> Scenario:
    check = Checker(source)
    top = check.mapping(
        data, "", {"name", "namespace", "description", "sampling"}, {"agents", "phases"}
    )
    name = check.text(top.get("name", Path(source).stem), "name")
    sampling = _sampling(check, top.get("sampling", {}))
    documents = _Documents(check, document_chars)
    roles = tuple(
        _role(check, item, f"agents[{i}]", documents)
        for i, item in enumerate(check.sequence(top["agents"], "agents"))
    )
    ids = [r.id for r in roles]
    for i, role in enumerate(roles):
        if ids.index(role.id) != i:
            check.fail(f"agents[{i}].id", f"agent {role.id!r} is defined twice")
        for heard in role.hears or ():
            if heard not in ids:
                check.fail(f"agents[{i}].hears", f"unknown agent {heard!r}")
    phases = tuple(
        _phase(check, item, f"phases[{i}]", ids)
        for i, item in enumerate(check.sequence(top["phases"], "phases"))
    )
    names = [p.name for p in phases]
    for i, phase in enumerate(phases):
        if names.index(phase.name) != i:
            check.fail(f"phases[{i}].name", f"phase {phase.name!r} is defined twice")
    return Scenario(
        name,
        namespace or _namespace(check, top, name),
        check.text(top.get("description", ""), "description", empty=True),
        roles,
        phases,
        dict(sampling),
    )


def _namespace(check: Checker, top: dict, name: str) -> str:
    if "namespace" in top:
        return check.ident(top["namespace"], "namespace", NAMESPACE_RE)
    if not NAMESPACE_RE.fullmatch(name):
        where = "name" if "name" in top else "name (the file's)"
        check.fail(
            where,
            f"{shown(name)} is no valid namespace (it must match {NAMESPACE_RE.pattern}), which "
            "the name is when no namespace is given: give a namespace",
        )
    return name


def run_scenario(
    scenario: Scenario,
    memory: AgentMemory,
    *,
    mode: str = "persistent",
    on_record: Callable[[Record], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    reset: bool = True,
    workflow: Workflow | None = None,
    phases: tuple[PhaseSpec, ...] | None = None,
) -> Workflow:
    """Runs the scenario's phases (or `phases`) in `memory` (whose namespace should be the
    scenario's). With `reset`, agents left by an earlier run are deleted first. Pass a
    `workflow` to go on with one that ran before."""
    if workflow is None:
        check_fits(scenario, memory)
        workflow = Workflow(
            memory, scenario.roles, mode=mode, sampling=scenario.sampling, on_record=on_record
        )
        if reset:
            for role in scenario.roles:
                memory.agent(role.id).delete()
    for spec in phases if phases is not None else scenario.phases:
        if on_phase is not None:
            on_phase(spec.name)
        with workflow.phase(spec.name, spec.brief, evict_after=spec.evict_after) as phase:
            for turn in spec.turns:
                extra = {} if turn.max_tokens is None else {"max_tokens": turn.max_tokens}
                phase.say(turn.agent, turn.say, **extra)
    return workflow


def check_fits(scenario: Scenario, memory: AgentMemory) -> None:
    """Refuses, before anything is reset, a max_tokens that no context of a worker's model
    could hold (it would fail mid-run, the earlier run's agents deleted). A worker that
    does not answer is passed by: routing finds another."""
    asked = [
        (t.max_tokens, f"phase {phase.name!r}, turn {i + 1} ({t.agent})")
        for phase in scenario.phases
        for i, t in enumerate(phase.turns)
        if t.max_tokens
    ]
    if scenario.sampling.get("max_tokens"):
        asked.append((scenario.sampling["max_tokens"], "sampling.max_tokens"))
    if not asked:
        return
    most, where = max(asked)
    for address, worker in memory.workers.items():
        try:
            context = worker.info().max_context
        except AgentKVError:
            continue
        if most >= context:
            raise OutOfRange(
                f"{scenario.name}: {where} asks for up to {most} tokens; the model of worker "
                f"{address} holds {context} tokens of context in all, prompt included"
            )


def _role(check: Checker, item: Any, where: str, documents: _Documents) -> Role:
    fields = check.mapping(item, where, {"system", "permanent", "hears", "document"}, {"id"})
    hears = fields.get("hears")
    if hears is not None:
        hears = tuple(
            check.ident(h, f"{where}.hears[{j}]")
            for j, h in enumerate(check.sequence(hears, f"{where}.hears", empty=True))
        )
    document = ""
    if "document" in fields:
        document = documents.add(fields["document"], f"{where}.document")
    return Role(
        check.ident(fields["id"], f"{where}.id"),
        check.text(fields.get("system", ""), f"{where}.system", empty=True),
        check.flag(fields.get("permanent", True), f"{where}.permanent"),
        hears,
        document,
    )


class _Documents:
    """The agents' documents as they are read: each module's source once, and every
    document's characters together at most MAX_DOCUMENTS."""

    def __init__(self, check: Checker, cap: int | None) -> None:
        self.check, self.cap, self.total = check, cap, 0
        self.sources: dict[str, str] = {}  # module -> its source

    def add(self, item: Any, where: str) -> str:
        check = self.check
        fields = check.mapping(item, where, {"text", "module", "chars"})
        if ("text" in fields) == ("module" in fields):
            check.fail(where, "give exactly one of text or module")
        if "text" in fields:
            if "chars" in fields:
                check.fail(f"{where}.chars", "goes with a module, not a text")
            text = check.text(fields["text"], f"{where}.text")
        else:
            module = check.text(fields["module"], f"{where}.module")
            chars = fields.get("chars", 14000)
            if not isinstance(chars, int) or isinstance(chars, bool) or chars < 1:
                check.fail(f"{where}.chars", f"must be a positive integer, not {shown(chars)}")
            text = self._source(module, f"{where}.module")[: min(chars, self.cap or chars)]
        self.total += len(text)
        if self.total > MAX_DOCUMENTS:
            check.fail(where, f"the documents pass {MAX_DOCUMENTS:,} characters in all, the limit")
        return text

    def _source(self, module: str, where: str) -> str:
        if module in self.sources:
            return self.sources[module]
        origin = _stdlib_source(module) if _MODULE.fullmatch(module) else None
        if origin is None:
            self.check.fail(where, f"{shown(module)} is not a pure-Python standard-library module")
        try:
            text = origin.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = (
                "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "cannot be read"
            )
            self.check.fail(where, f"{module!r} ({origin}) {reason}")
        self.sources[module] = text
        return text


def _stdlib_source(module: str) -> Path | None:
    """The source file of a standard-library module, found without importing anything."""
    base = Path(sysconfig.get_paths()["stdlib"]).joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        try:
            if path.is_file():
                return path
        except OSError:  # a name too long for the file system is no module
            return None
    return None


def _sampling(check: Checker, value: Any) -> dict[str, Any]:
    """The scenario's sampling, each value of the type and range the worker takes."""
    sampling = dict(check.mapping(value, "sampling", SAMPLING_FIELDS))
    for name, low, high in (("top_k", 0, 2**32), ("seed", 0, 2**64)):
        if name in sampling:
            sampling[name] = check.whole(sampling[name], f"sampling.{name}", low, high)
    if "max_tokens" in sampling:
        sampling["max_tokens"] = _max_tokens(check, sampling["max_tokens"], "sampling.max_tokens")
    for name, high in (("temperature", MAX_TEMPERATURE), ("top_p", 1.0)):
        number = sampling.get(name, 0.0)
        real = isinstance(number, (int, float)) and not isinstance(number, bool)
        if not real or not 0 <= number <= high:
            check.fail(
                f"sampling.{name}", f"must be a number in [0, {high:g}], not {shown(number)}"
            )
    stop = sampling.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        check.fail("sampling.stop", f"must be text or a list of texts, not {shown(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        check.fail("sampling.stop", f"{len(stops)} stop strings, limit {MAX_STOP_STRINGS}")
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        check.fail("sampling.stop", f"a stop string has {MAX_STOP_CHARS} characters at most")
    if stops:
        sampling["stop"] = stops
    return sampling


def _max_tokens(check: Checker, value: Any, where: str) -> int:
    """Tokens to generate: never more than an agent holds, whatever its model."""
    tokens = check.whole(value, where, 1, 2**32)
    if tokens > MAX_TOKENS:
        check.fail(
            where,
            f"{tokens} is more than an agent can hold: {MAX_TOKENS} tokens with its context, a "
            "store's default limit (a worker refuses a turn past its model's context, most far "
            "less)",
        )
    return tokens


def _phase(check: Checker, item: Any, where: str, ids: list[str]) -> PhaseSpec:
    fields = check.mapping(item, where, {"brief", "evict_after"}, {"name", "turns"})
    turns = []
    for j, turn in enumerate(check.sequence(fields["turns"], f"{where}.turns")):
        at = f"{where}.turns[{j}]"
        t = check.mapping(turn, at, {"max_tokens"}, {"agent", "say"})
        agent = check.ident(t["agent"], f"{at}.agent")
        if agent not in ids:
            check.fail(f"{at}.agent", f"unknown agent {agent!r} (agents: {', '.join(ids)})")
        max_tokens = t.get("max_tokens")
        if max_tokens is not None:
            max_tokens = _max_tokens(check, max_tokens, f"{at}.max_tokens")
        turns.append(Turn(agent, check.text(t["say"], f"{at}.say"), max_tokens))
    name = check.text(fields["name"], f"{where}.name")
    if len(name) > MAX_PHASE:
        check.fail(f"{where}.name", f"is {len(name)} characters, limit {MAX_PHASE}")
    return PhaseSpec(
        name,
        check.text(fields.get("brief", ""), f"{where}.brief", empty=True),
        tuple(turns),
        check.flag(fields.get("evict_after", False), f"{where}.evict_after"),
    )
