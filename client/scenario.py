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
its aliases (*name) written out; it gives each key once; a max_tokens is at most 2^21, as
many as an agent holds with its context in a store at its defaults.
"""

from __future__ import annotations

import re
import reprlib
import sysconfig
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentkv.client.memory import AgentMemory
from agentkv.client.workflow import Record, Role, Workflow
from agentkv.errors import AgentKVError, InvalidArgument, OutOfRange
from agentkv.ids import (
    AGENT_ID_RE,
    MAX_PHASE,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    NAMESPACE_RE,
)

SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed"}
MAX_SCENARIO_BYTES = 1 << 20
MAX_EXPANDED = MAX_SCENARIO_BYTES  # characters and values, once its aliases are written out
# As many tokens as an agent holds, its context included, in a store at its defaults (its
# max_agent_tokens): a turn asking more is absurd whatever the model, whose context the
# scenario cannot know (a worker refuses a turn past it).
MAX_TOKENS = 1 << 21
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class ScenarioError(InvalidArgument):
    """A scenario file that cannot run, with where and why."""


_SHOWN = reprlib.Repr()  # its output bounded, whatever the value, in time and length
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 80, 80


def _shown(value: Any, limit: int = 100) -> str:
    """`value` as Python writes it, cut short: a message stays one short line."""
    text = _SHOWN.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Expands(Exception):
    """A document whose aliases repeat so much that, written out, it is over MAX_EXPANDED."""


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser, if built
    """yaml's safe loader, refusing a mapping that gives a key twice (yaml keeps the last),
    and a document that its aliases expand past MAX_EXPANDED ("billion laughs": yaml shares
    an alias's value, but a merge key copies it, and a check walks and shows it whole)."""

    def construct_document(self, node):
        if _expanded_size(node) > MAX_EXPANDED:
            raise _Expands
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges keys that this mapping may override
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # refused by yaml itself, as unhashable
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {_shown(key)} appears twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_size(root: yaml.Node) -> int:
    """The characters of `root`'s scalars plus its values, each counted wherever an alias
    repeats it; 0 for a document without aliases (the file's size bounds it). Counting
    stops past MAX_EXPANDED, and a value that holds itself is endless."""
    sizes: dict[int, int] = {}
    inside: set[int] = set()  # the values being counted, root first
    aliased = False
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        if counted:
            inside.discard(id(node))
            own = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            sizes[id(node)] = 1 + own + sum(sizes[id(child)] for child in _children(node))
            if aliased and sizes[id(node)] > MAX_EXPANDED:
                break
        elif id(node) in inside:
            return MAX_EXPANDED + 1
        elif id(node) in sizes:
            aliased = True
        else:
            inside.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
    return max(sizes.values()) if aliased else 0


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


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


def load_scenario(path: str | Path, document_chars: int | None = None) -> Scenario:
    """Reads and checks a scenario file. `document_chars` caps every module document (tests
    run the shipped scenarios on tiny models with short contexts)."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_SCENARIO_BYTES + 1)  # no more: it may be endless (/dev/zero)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{path}: over 1 MiB ({MAX_SCENARIO_BYTES} bytes), the limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text (a bad byte at offset {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except _Expands:
        raise ScenarioError(
            f"{path}: its aliases (*name) repeat so much that written out it would pass 1 MiB "
            f"({MAX_EXPANDED} characters and values), the limit"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ScenarioError(f"{path}:{where}: not valid YAML: {problem}") from None
    return parse_scenario(data, str(path), document_chars)


def parse_scenario(data: Any, source: str = "scenario", document_chars: int | None = None):
    check = _Checker(source)
    top = check.mapping(
        data, "", {"name", "namespace", "description", "sampling"}, {"agents", "phases"}
    )
    name = check.text(top.get("name", Path(source).stem), "name")
    sampling = _sampling(check, top.get("sampling", {}))
    roles = tuple(
        _role(check, item, f"agents[{i}]", document_chars)
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
        _namespace(check, top, name),
        check.text(top.get("description", ""), "description", empty=True),
        roles,
        phases,
        dict(sampling),
    )


def _namespace(check: _Checker, top: dict, name: str) -> str:
    if "namespace" in top:
        return check.ident(top["namespace"], "namespace", NAMESPACE_RE)
    if not NAMESPACE_RE.fullmatch(name):
        where = "name" if "name" in top else "name (the file's)"
        check.fail(
            where,
            f"{_shown(name)} is no valid namespace (it must match {NAMESPACE_RE.pattern}), which "
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


def _role(check: _Checker, item: Any, where: str, document_chars: int | None) -> Role:
    fields = check.mapping(item, where, {"system", "permanent", "hears", "document"}, {"id"})
    hears = fields.get("hears")
    if hears is not None:
        hears = tuple(
            check.ident(h, f"{where}.hears[{j}]")
            for j, h in enumerate(check.sequence(hears, f"{where}.hears", empty=True))
        )
    document = ""
    if "document" in fields:
        document = _document(check, fields["document"], f"{where}.document", document_chars)
    return Role(
        check.ident(fields["id"], f"{where}.id"),
        check.text(fields.get("system", ""), f"{where}.system", empty=True),
        check.flag(fields.get("permanent", True), f"{where}.permanent"),
        hears,
        document,
    )


def _document(check: _Checker, item: Any, where: str, cap: int | None) -> str:
    fields = check.mapping(item, where, {"text", "module", "chars"})
    if ("text" in fields) == ("module" in fields):
        check.fail(where, "give exactly one of text or module")
    if "text" in fields:
        return check.text(fields["text"], f"{where}.text")
    module = check.text(fields["module"], f"{where}.module")
    chars = fields.get("chars", 14000)
    if not isinstance(chars, int) or isinstance(chars, bool) or chars < 1:
        check.fail(f"{where}.chars", f"must be a positive integer, not {_shown(chars)}")
    origin = _stdlib_source(module) if _MODULE.fullmatch(module) else None
    if origin is None:
        check.fail(
            f"{where}.module", f"{_shown(module)} is not a pure-Python standard-library module"
        )
    try:
        text = origin.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "cannot be read"
        check.fail(f"{where}.module", f"{module!r} ({origin}) {reason}")
    return text[: min(chars, cap or chars)]


def _stdlib_source(module: str) -> Path | None:
    """The source file of a standard-library module, found without importing anything."""
    base = Path(sysconfig.get_paths()["stdlib"]).joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _sampling(check: _Checker, value: Any) -> dict[str, Any]:
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
                f"sampling.{name}", f"must be a number in [0, {high:g}], not {_shown(number)}"
            )
    stop = sampling.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        check.fail("sampling.stop", f"must be text or a list of texts, not {_shown(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        check.fail("sampling.stop", f"{len(stops)} stop strings, limit {MAX_STOP_STRINGS}")
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        check.fail("sampling.stop", f"a stop string has {MAX_STOP_CHARS} characters at most")
    if stops:
        sampling["stop"] = stops
    return sampling


def _max_tokens(check: _Checker, value: Any, where: str) -> int:
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


def _phase(check: _Checker, item: Any, where: str, ids: list[str]) -> PhaseSpec:
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


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str):
        raise ScenarioError(f"{self.source}: {where or 'top level'}: {message}")

    def mapping(self, value: Any, where: str, optional: set, required: set = frozenset()):
        if not isinstance(value, dict):
            self.fail(where, f"must be a mapping, not {type(value).__name__}")
        unknown = sorted(set(map(str, value)) - optional - required)
        if unknown:
            allowed = ", ".join(sorted(optional | required))
            self.fail(where, f"unknown key {_shown(unknown[0])} (allowed: {allowed})")
        missing = sorted(required - set(value))
        if missing:
            self.fail(where, f"missing key {missing[0]!r}")
        return value

    def sequence(self, value: Any, where: str, empty: bool = False) -> list:
        if not isinstance(value, list):
            self.fail(where, f"must be a list, not {type(value).__name__}")
        if not value and not empty:
            self.fail(where, "must not be empty")
        return value

    def text(self, value: Any, where: str, empty: bool = False) -> str:
        if not isinstance(value, str):
            self.fail(where, f"must be text, not {type(value).__name__}")
        if not empty and not value.strip():
            self.fail(where, "must not be empty")
        return value

    def ident(self, value: Any, where: str, pattern: re.Pattern = AGENT_ID_RE) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            self.fail(where, f"{_shown(value)} is not a valid id (it must match {pattern.pattern})")
        return value

    def whole(self, value: Any, where: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
            bound = f"2^{high.bit_length() - 1}"
            self.fail(where, f"must be a whole number in [{low}, {bound}), not {_shown(value)}")
        return value

    def flag(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            self.fail(where, f"must be true or false, not {_shown(value)}")
        return value
