"""Command-line flags from a config dataclass: a field made with `flag(...)` is one flag, with
its help text, its default (shown by --help) and its parser written once, beside the field.

    @dataclass
    class Config:
        quota_bytes: int = flag(0, "payload byte quota, e.g. 20G", name="quota", parse=parse_bytes)
        security: ServerSecurity = nested(ServerSecurity)

    config = parse_config(Config, "agentkv-store", __doc__, argv)

A field's flag is `--` + its name with dashes (or `name`), after the nested prefix; a bool
field is a switch that flips its default; a field without a default is a required flag.
Fields made with plain `field()` are settings no flag sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

C = TypeVar("C")
MISSING = dataclasses.MISSING


def flag(
    default: Any = MISSING,
    help: str = "",
    *,
    name: str | None = None,
    parse: Callable[[str], Any] | None = None,
    convert: Callable[[Any], Any] | None = None,
    env: bool = False,
    shown: str | None = None,
    factory: Callable[[], Any] | None = None,
    kw_only: Any = MISSING,
    **argparse_options: Any,
) -> Any:
    """A dataclass field that is also a flag. `parse` turns the flag's text into a value
    (default: the field's type); `convert` turns what argparse collected into the field's
    value; `env` reads the default from AGENTKV_<FLAG>; `shown` is the default as --help
    words it (instead of its repr); `kw_only` is dataclasses'; the rest goes to argparse's
    add_argument."""
    metadata = {
        "help": help,
        "name": name,
        "parse": parse,
        "convert": convert,
        "env": env,
        "shown": shown,
        "options": argparse_options,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata, kw_only=kw_only)
    return dataclasses.field(default=default, metadata=metadata, kw_only=kw_only)


def nested(cls: Callable[[], Any], prefix: str = "") -> Any:
    """A field holding another flagged config (its flags named `--PREFIX...`)."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls, "prefix": prefix})


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One flag per flagged field of `cls` (and of its nested configs)."""
    hints = typing.get_type_hints(cls)
    own = inspect.get_annotations(cls)  # a subclass's own flags before its base's
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        if "nested" in f.metadata:
            add_flags(parser, f.metadata["nested"], prefix + f.metadata["prefix"])
        elif "help" in f.metadata:
            name = _flag_name(f, prefix)
            parser.add_argument(name, dest=_dest(prefix, f), **_options(f, hints[f.name], name))


def from_args(cls: type[C], args: argparse.Namespace, prefix: str = "", **given: Any) -> C:
    """`cls` built from parsed flags; `given` fields are set as they are. A nested config's
    error names its flags with their prefix, as they were given (--store-tls-ca, not the
    --tls-ca its class knows)."""
    values = dict(given)
    try:
        for f in dataclasses.fields(cls):
            if f.name in given:
                continue
            if "nested" in f.metadata:
                nested_prefix = prefix + f.metadata["prefix"]
                values[f.name] = from_args(f.metadata["nested"], args, nested_prefix)
            elif "help" in f.metadata:
                value = getattr(args, _dest(prefix, f))
                convert = f.metadata["convert"]
                values[f.name] = convert(value) if convert else value
        return cls(**values)
    except ValueError as exc:
        message = _prefixed(str(exc), cls, prefix) if prefix else str(exc)
        message = _as_flags(message, cls, prefix)
        message = _from_environment(message, cls, args, prefix)
        if message == str(exc):
            raise
        raise ValueError(message) from None


def _prefixed(message: str, cls: type, prefix: str) -> str:
    """`message` with each of `cls`'s own flags (--NAME) written --PREFIXNAME."""
    names = [_flag_name(f)[2:] for f in dataclasses.fields(cls) if "help" in f.metadata]
    flags = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    return re.sub(_whole(f"--({flags})"), rf"--{prefix}\1", message)


def _as_flags(message: str, cls: type, prefix: str) -> str:
    """`message` with each of `cls`'s fields that its checks name as the field
    (hot_budget_bytes) written as the flag a user gave (--hot-budget): one with an
    underscore anywhere (no word of a sentence has one), another where it starts the
    message ("workers must be >= 2")."""
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            name = _flag_name(f, prefix)
            field = (  # not inside a path: a folder may be called address_file
                rf"(?<![\w./-]){re.escape(f.name)}(?![\w/-])"
                if "_" in f.name
                else f"^{re.escape(f.name)}(?= )"
            )
            message = re.sub(field, name, message)
    return message


def _flag_name(f: dataclasses.Field, prefix: str = "") -> str:
    """The flag of a flagged field: --PREFIX plus its name, or the field's with dashes."""
    return "--" + prefix + (f.metadata["name"] or f.name.replace("_", "-"))


def _whole(flag: str) -> str:
    """A pattern of `flag` (a regex) as a whole flag in a message, not part of a longer one."""
    return rf"(?<![\w-]){flag}(?![\w-])"


def _from_environment(message: str, cls: type, args: argparse.Namespace, prefix: str) -> str:
    """`message` with each of `cls`'s flags whose value came from its environment variable
    named as that variable too: AGENTKV_TLS_CA (--tls-ca) /dir: is a directory."""
    for f in dataclasses.fields(cls):
        if not f.metadata.get("env"):
            continue
        name = _flag_name(f, prefix)
        variable = _variable(name)
        given = getattr(args, _dest(prefix, f), None)
        if os.environ.get(variable) and given == os.environ[variable]:
            message = re.sub(_whole(re.escape(name)), f"{variable} ({name})", message)
    return message


def _variable(name: str) -> str:
    """The environment variable a flag's default is read from (`env`)."""
    return "AGENTKV_" + name[2:].replace("-", "_").upper()


def parse_config(
    cls: type[C], prog: str, description: str | None, argv: Sequence[str] | None = None
) -> C:
    """The config from the command line; a value its checks refuse exits with usage."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    negative_values(parser)
    add_flags(parser, cls)
    args = parser.parse_args(argv)
    try:
        return from_args(cls, args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))


def check_files(config: Any, names: Sequence[str]) -> None:
    """Each named field that is set names a readable file: a missing one is a usage error
    while the flags are parsed, not a traceback once the server starts."""
    for name in names:
        path = getattr(config, name)
        try:
            if path:
                open(path, "rb").close()
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise ValueError(f"--{name.replace('_', '-')} {path}: {reason}") from None


class _DefaultsHelp(argparse.HelpFormatter):
    """--help shows each flag's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, "", [], argparse.SUPPRESS)
        said = "%(default)" in text or "(default:" in text  # its help says it already
        if shown and not said and action.option_strings:
            text += " (default: %(default)s)"
        return text


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's --help shows its flags' defaults (those worth showing), and takes
    negative values as values (negative_values)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.formatter_class = _DefaultsHelp
                negative_values(command)
                show_defaults(command)


def negative_values(parser: argparse.ArgumentParser) -> None:
    """`--hot-budget -1G` gives the flag "-1G", which its parser then refuses by name: before
    Python 3.13, argparse took only "-1" and "-1.5" for negative numbers, and "-1G" for an
    unknown option ("expected one argument"). No flag of ours starts with a digit."""
    parser._negative_number_matcher = re.compile(r"^-\.?\d")


def _dest(prefix: str, f: dataclasses.Field) -> str:
    return (prefix + f.name).replace("-", "_")


def _options(f: dataclasses.Field, hint: Any, name: str) -> dict[str, Any]:
    """add_argument's keywords for one field: its help, default, parser and action."""
    meta = f.metadata
    parse = telling(meta["parse"]) if meta["parse"] else _scalar(hint)
    options: dict[str, Any] = {"help": meta["help"], "type": parse}
    if "choices" not in meta["options"]:  # else --help lists the choices
        options["metavar"] = name[2:].upper().replace("-", "_")
    if f.default is not MISSING:
        default = f.default
    elif f.default_factory is not MISSING:
        default = f.default_factory()
    else:
        return {**options, "required": True, **meta["options"]}
    if meta["options"].get("action") == "append":
        return {**options, "default": [], **meta["options"]}
    if isinstance(default, bool):
        action = "store_false" if default else "store_true"
        return {"help": meta["help"], "action": action, **meta["options"]}
    if meta["env"]:
        variable = _variable(name)
        default = os.environ.get(variable, default)
        options["help"] += f" (env {variable})"
    shown = meta["shown"] or (None if default in (None, "") else "%(default)s")
    if shown:
        options["help"] += f" (default: {shown})"
    return {**options, "default": default, **meta["options"]}


def telling(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its ValueError's message shown in the usage error (argparse shows only
    "invalid <name> value" for a ValueError)."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_flag


def _scalar(hint: Any) -> Callable[[str], Any]:
    """The type argparse parses a flag's text with: the hint, or its one non-None member (a
    float finite: no setting means "nan" or "inf" seconds)."""
    members = [t for t in typing.get_args(hint) if t is not type(None)]
    scalar = members[0] if len(members) == 1 else hint
    return telling(_finite) if scalar is float else scalar


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value
