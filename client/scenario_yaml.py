"""A scenario file read safely (at most 1 MiB, UTF-8, YAML with no key given twice and no
alias bomb) and the checks its fields go through, each error naming the file and place."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from agentkv.errors import InvalidArgument
from agentkv.ids import AGENT_ID_RE

MAX_SCENARIO_BYTES = 1 << 20
MAX_EXPANDED = MAX_SCENARIO_BYTES  # characters and values, once its aliases are written out


class ScenarioError(InvalidArgument):
    """A scenario file that cannot run, with where and why."""


_SHOWN = reprlib.Repr()  # its output bounded, whatever the value, in time and length
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 80, 80


def shown(value: Any, limit: int = 100) -> str:
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
        if not isinstance(node, yaml.MappingNode):  # `!!set [1]`: yaml's own error says so
            return super().construct_mapping(node, deep)
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges keys that this mapping may override
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # refused by yaml itself, as unhashable
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {shown(key)} appears twice", key_node.start_mark
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


def read_yaml(path: Path) -> Any:
    """The file's YAML document, or a ScenarioError saying why it cannot be read."""
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
    except RecursionError:  # yaml's pure-Python parser, where libyaml is not built
        raise ScenarioError(f"{path}: not valid YAML: it nests too deeply") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # a tagged value its tag cannot hold (`!!bool maybe`, `!!float abc`, `!!timestamp x`,
        # an int past Python's 4,300 digits): yaml's constructors raise these bare
        said = str(exc) if len(str(exc)) <= 200 else str(exc)[:197] + "..."
        message = f"{path}: not valid YAML: a value its tag cannot hold ({said})"
        raise ScenarioError(message) from None
    return data


class Checker:
    """Checks of a scenario's fields, each failing with a ScenarioError that names the file
    (`source`) and the place in it (`where`)."""

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
            self.fail(where, f"unknown key {shown(unknown[0])} (allowed: {allowed})")
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
            self.fail(where, f"{shown(value)} is not a valid id (it must match {pattern.pattern})")
        return value

    def whole(self, value: Any, where: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
            bound = f"2^{high.bit_length() - 1}"
            self.fail(where, f"must be a whole number in [{low}, {bound}), not {shown(value)}")
        return value

    def flag(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            self.fail(where, f"must be true or false, not {shown(value)}")
        return value
