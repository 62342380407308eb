"""agentkv: the command line.

agentkv demo                 start a store and a worker, run the prisoner's dilemma workflow
agentkv bench --quick|--full run every benchmark, write one report with the paper's tables
agentkv run SCENARIO         run a workflow scenario (a YAML file, or a shipped one by name)
agentkv agents               list agents with their tier (hot, warm, cold), tokens and bytes
agentkv store stats|namespaces|agents|agent|blocks|verify|gc|delete   inspect and maintain a store
agentkv walkthrough          a guided tour of the store and the worker
agentkv plan [--config NAME] --context 8K --budget 10.2Gi   how many agents' KV caches fit
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m: its imports below run as the console script's do
    from agentkv.entry import agentkv

    agentkv()
    raise SystemExit

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentkv import defaults, ids, tether
from agentkv.addresses import client_address
from agentkv.channels import ClientSecurity, header_token
from agentkv.client.inspect import STORE_COMMANDS, print_elsewhere
from agentkv.client.store import StoreClient
from agentkv.errors import (
    NOT_HTTP2,
    AgentKVError,
    AgentNotFound,
    DeadlineExceeded,
    FingerprintMismatch,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
    connect_failure,
)
from agentkv.flags import add_flags, from_args, show_defaults, telling
from agentkv.launch import ServiceExited
from agentkv.plan_report import print_plan
from agentkv.planner import parse_size, parse_tokens
from agentkv.units import human_bytes, table

if TYPE_CHECKING:
    from agentkv.client.memory import AgentMemory
    from agentkv.v1.store_pb2 import AgentSummary

LISTING_SECONDS = 60.0  # a call of `agentkv agents` or `store` (but verify's) may take


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _store_parser(sub.add_parser("store", help="inspect and maintain a cache store"))
    walk = sub.add_parser("walkthrough", help="start a store and tour what it does")
    walk.add_argument("--keep", action="store_true", help="keep the data directory afterwards")
    sub.add_parser("bench", help="run the benchmarks and write one report (from a source checkout)")
    sub.add_parser("gateway", help="serve the OpenAI and Anthropic APIs (agentkv-gateway's flags)")
    demo = sub.add_parser("demo", help="start a store and a worker and run a workflow")
    demo.add_argument(
        "--model", help="a shipped name, GGUF file or mlx-lm model directory (default: SmolLM2)"
    )
    demo.add_argument("--keep", action="store_true", help="keep data and logs afterwards")
    demo.add_argument("--no-cold", action="store_true", help="skip the re-prefill comparison")
    run = sub.add_parser("run", help="run a workflow scenario against running services")
    run.add_argument("scenario", help="a YAML file, or a shipped scenario's name")
    run.add_argument(
        "--mode",
        choices=("persistent", "cold"),
        default="persistent",
        help="persistent: agents keep their caches; cold: every phase re-prefills (the baseline)",
    )
    run.add_argument("--no-reset", action="store_true", help="keep agents of an earlier run")
    run.add_argument(
        "-n", "--namespace", type=namespace_flag, help="namespace (default: the scenario's)"
    )
    agents = sub.add_parser("agents", help="list agents: tier, tokens, bytes, phase")
    agents.add_argument(
        "-n", "--namespace", type=namespace_flag, default="default", help="namespace"
    )
    # a turn's call lasts its whole reply: a cold prefill of a long context takes minutes
    _service_flags(run, 300.0, " (a turn's lasts its whole reply)")
    _service_flags(agents, LISTING_SECONDS)
    _plan_flags(sub.add_parser("plan", help="how many agents' KV caches fit in a memory budget"))
    _model_parser(sub.add_parser("model", help="import GGUF models"))
    show_defaults(parser)
    _named_commands(parser)
    return parser


def _named_commands(parser: argparse.ArgumentParser) -> None:
    """Every subcommand group of `parser` (and of its subcommands) named by its commands
    in usage errors, "required: {stats,agents,...}", not its dest ("store_command")."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            action.metavar = "{" + ",".join(action.choices) + "}"
            for sub in action.choices.values():
                _named_commands(sub)


def _store_parser(store: argparse.ArgumentParser) -> None:
    _store_flag(store)
    add_flags(store, ClientSecurity)
    store_sub = store.add_subparsers(dest="store_command", required=True)
    for name, (_, help_text) in STORE_COMMANDS.items():
        p = store_sub.add_parser(name, help=help_text)
        # the same flags after the command too; only given ones override those before it
        _store_flag(p)
        add_flags(p, ClientSecurity)
        for action in p._actions:
            if action.dest in ("store", *(f.name for f in dataclasses.fields(ClientSecurity))):
                action.default = argparse.SUPPRESS
        if name != "stats":
            p.add_argument(
                "-n",
                "--namespace",
                type=namespace_flag,
                default=None if name in ("verify", "gc") else "default",
                help="namespace (every one when omitted)"
                if name in ("verify", "gc")
                else "namespace (default: default)",
            )
        if name in ("agent", "delete"):
            p.add_argument("agent_id", help="the agent's id")


def namespace_flag(value: str) -> str:
    """-n's value, checked: an empty one is refused, where the store would read it as the
    default namespace (or, for verify and gc, as all), as a script's unset variable would."""
    if not value:
        raise argparse.ArgumentTypeError("an empty namespace: name one, or leave out -n")
    try:
        return ids.namespace(value)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _model_parser(model: argparse.ArgumentParser) -> None:
    model_sub = model.add_subparsers(dest="model_command", required=True)
    imp = model_sub.add_parser("import", help="a GGUF file as an mlx-lm model directory")
    imp.add_argument("file", help="a .gguf file, or a shipped model's name")
    imp.add_argument("--out", type=Path, help="directory to write (default: the model cache)")
    imp.add_argument(
        "--weights",
        default="float32",
        choices=("float32", "float16", "bfloat16", "native"),
        help="dequantize to a float dtype, or keep the file's own 4/8-bit layers (native)",
    )


def cmd_model_import(args: argparse.Namespace) -> int:
    """Runs the import in the worker's own package, as a process of its own: the CLI sits
    on every layer, but lives in agentkv/, so it imports none of the worker's modules."""
    command = ["-m", "inference_worker.model_import", args.file, "--weights", args.weights]
    return _run_child([*command, *(["--out", str(args.out)] if args.out else [])])


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _run_child(target: list[str], **popen: object) -> int:
    """Runs `python TARGET` (bench, model import) to its end: its exit code (a
    shell's 128+N when signal N ended it). It runs in a session of its own, and the CLI
    passes it SIGINT, SIGTERM and SIGHUP: a Ctrl-C, which a terminal sends to the CLI's
    whole process group, reaches it once, as one sent to the CLI alone does. The child
    cleans up and says "interrupted" itself."""
    command = tether.command(os.getpid(), signal.SIGTERM, target)  # ended with the CLI
    child = subprocess.Popen(command, start_new_session=True, **popen)

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)

    caught = [sig for sig in FORWARDED if signal.getsignal(sig) != signal.SIG_IGN]  # nohup's
    previous = {sig: signal.signal(sig, forward) for sig in caught}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=defaults.MODEL,
        help=f"a config.json, a model directory, or a shipped name (default: {defaults.MODEL})",
    )
    p.add_argument(
        "--context",
        action="append",
        type=telling(parse_tokens),
        help="context tokens, e.g. 8192 or 8K; repeat for several",
    )
    p.add_argument("--budget", type=telling(parse_size), help="e.g. 10.2Gi (2^30) or 10.2G (10^9)")
    p.add_argument("--bits", type=_at_least(1), default=4, help="quantized K/V bits")
    p.add_argument(
        "--group-size", type=_at_least(1), default=64, help="elements per scale and bias"
    )
    p.add_argument(
        "--chunk",
        type=_at_least(0),
        default=0,
        help="prefill chunk in flight, held beyond the window",
    )


def _at_least(least: int) -> Callable[[str], int]:
    """A whole number of at least `least`, the usage error naming the flag as typed."""

    def whole(text: str) -> int:
        digits = text.strip().lstrip("-")
        if not (digits.isascii() and digits.isdigit()) or int(text) < least:
            raise ValueError(f"a whole number of at least {least}, got {text!r}")
        return int(text)

    return telling(whole)


def _store_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        type=telling(client_address),
        help=f"store address, HOST:PORT or unix:PATH (env AGENTKV_STORE; default: "
        f"{defaults.STORE_ADDRESS})",
    )


def _service_flags(p: argparse.ArgumentParser, timeout: float, calls: str = "") -> None:
    _store_flag(p)
    p.add_argument(
        "--worker",
        action="append",
        type=telling(client_address),
        help=f"worker address; repeat for several (env AGENTKV_WORKERS, comma-separated; "
        f"default: {defaults.WORKER_ADDRESS})",
    )
    p.add_argument(
        "--timeout",
        type=telling(_seconds),
        default=timeout,
        metavar="SECONDS",
        help=f"seconds a call to a worker or the store may take{calls}",
    )
    add_flags(p, ClientSecurity)


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"not a number of seconds above 0: {text!r}")
    return value


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The parser of the command `args` ran: its usage line goes with a usage error."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[args.command]


def _addresses_from_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--store and --worker not given: env AGENTKV_STORE and AGENTKV_WORKERS (comma-separated),
    set but empty counting as unset, else the defaults. A malformed one is a usage error."""
    name = "AGENTKV_STORE"
    try:
        if getattr(args, "store", "") is None:  # "": a command without the flag
            args.store = client_address((os.environ.get(name) or defaults.STORE_ADDRESS).strip())
        name = "AGENTKV_WORKERS"
        if getattr(args, "worker", "") is None:
            workers = os.environ.get(name) or defaults.WORKER_ADDRESS
            args.worker = [client_address(w.strip()) for w in workers.split(",")]
    except ValueError as exc:
        parser.error(f"env {name}: {exc}")


def _security(args: argparse.Namespace) -> ClientSecurity:
    """The flags' ClientSecurity; with no --token-file, the token is env AGENTKV_TOKEN's."""
    security = from_args(ClientSecurity, args)
    if security.token or not (token := os.environ.get("AGENTKV_TOKEN", "").strip()):
        return security
    return dataclasses.replace(security, token=header_token(token, "env AGENTKV_TOKEN"))


def _workers(args: argparse.Namespace) -> list[str]:
    return args.worker  # --worker, or env AGENTKV_WORKERS, or the default


def cmd_bench(rest: list[str]) -> int:
    """Runs benchmarks/report.py, which lives in the source tree, not in the package."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "report.py"
    if not script.exists():
        print(
            f"error: {script} not found: agentkv bench runs from a source checkout", file=sys.stderr
        )
        return 2
    return _run_child([str(script), *rest])  # in this directory: --out and --model are its


def cmd_with_services(args: argparse.Namespace) -> None:
    """walkthrough and demo, which start services of their own. A SIGTERM or SIGHUP (a closed
    terminal) ends them as an error does, exit 128+N, which stops the services and removes
    the data; Python's default ended the CLI on the spot."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:  # nohup's
            signal.signal(sig, lambda number, _frame: sys.exit(128 + number))
    if args.command == "walkthrough":
        from agentkv.client.walkthrough import run

        run(keep=args.keep)
    else:
        from agentkv.client import demo

        demo.run(args.model or defaults.MODEL, args.keep, not args.no_cold)


def cmd_run(args: argparse.Namespace) -> None:
    from agentkv.client.demo import print_record, scenario_path
    from agentkv.client.memory import AgentMemory
    from agentkv.client.scenario import load_scenario, run_scenario

    scenario = load_scenario(scenario_path(args.scenario), namespace=args.namespace or "")
    namespace = scenario.namespace
    print(f"{scenario.name} ({args.mode}) in namespace {namespace!r}: {scenario.description}")
    with AgentMemory(
        _workers(args), args.store, namespace, timeout=args.timeout, security=_security(args)
    ) as mem:
        try:
            run_scenario(
                scenario,
                mem,
                mode=args.mode,
                on_record=print_record,
                on_phase=lambda name: print(f"  phase {name}"),
                reset=not args.no_reset,
            )
        except AgentNotFound as exc:  # one of its own agents, made by this run
            if not exc.remote:
                raise
            raise AgentNotFound(
                f"{exc.message}: gone while this run used it; another agentkv run in "
                f"namespace {namespace!r}? (give each its own -n NAME)"
            ) from None


def cmd_list_agents(args: argparse.Namespace) -> None:
    from agentkv.client.memory import AgentMemory

    with AgentMemory(
        _workers(args), args.store, args.namespace, timeout=args.timeout, security=_security(args)
    ) as mem:
        rows, failure = _agent_rows(mem, list(mem.store.list_agents(args.namespace)))
        print(table(["agent", "tier", "tokens", "bytes", "phase", "worker"], rows))
        print_elsewhere(mem.store, args.namespace, rows)
    if failure is not None:  # some tiers are unknown: the listing is incomplete
        raise failure


def _agent_rows(
    mem: AgentMemory, summaries: list[AgentSummary]
) -> tuple[list[list[object]], AgentKVError | None]:
    """Each agent as its worker describes it. One it cannot describe is listed as the store
    has it, its tier saying why: "other model" (written under another model's fingerprint),
    or "?" (the first such error is returned). Once a worker cannot be reached or does not
    answer, the rest are not asked."""
    from agentkv.client.core import OTHER_MODEL
    from agentkv.client.memory import Agent

    rows: list[list[object]] = []
    failure: AgentKVError | None = None
    asking = True
    for summary in summaries:
        state, tier = summary, "?"
        if asking:
            try:
                state = Agent(mem, summary.agent_id).describe()
                tier = state.tier
            except FingerprintMismatch:
                tier = OTHER_MODEL
            except AgentNotFound:
                continue  # deleted since it was listed
            except AgentKVError as exc:
                failure, asking = failure or exc, exc.remote  # remote: it answered, for that one
        size = human_bytes(state.num_bytes)
        where = mem.worker_for(summary.agent_id)
        rows.append([summary.agent_id, tier, state.num_tokens, size, state.phase, where])
    return rows, failure


def cmd_plan(args: argparse.Namespace) -> None:
    print_plan(args.config, args.context, args.budget, args.bits, args.group_size, args.chunk)


def main(argv: list[str] | None = None) -> None:
    try:
        try:
            _main(sys.argv[1:] if argv is None else argv)
        finally:
            sys.stdout.flush()  # here, where a reader gone is caught, not at exit
    except KeyboardInterrupt:  # what was started is stopped, what was made removed, by then
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # another Ctrl-C now: no traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # its reader left (`| head`): nothing more to say, as Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
        sys.exit(141)  # 128 + SIGPIPE: what a shell reports for a writer whose pipe closed


def _main(argv: list[str]) -> None:
    if argv[:1] == ["bench"]:  # every other argument is benchmarks/report.py's
        sys.exit(cmd_bench(argv[1:]))
    if argv[:1] == ["gateway"]:  # agentkv-gateway, its flags as they are
        from agentkv.gateway.__main__ import main as gateway

        gateway(argv[1:], prog="agentkv gateway")
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "plan" and not (args.context and args.budget):
        _command_parser(parser, args).error("plan needs --context and --budget")
    if args.command == "run" and args.mode == "cold" and args.no_reset:  # it failed mid-run
        _command_parser(parser, args).error(
            "--mode cold starts every agent from nothing: --no-reset has nothing to keep"
        )
    _addresses_from_env(_command_parser(parser, args), args)
    try:
        if args.command in ("walkthrough", "demo"):
            cmd_with_services(args)
            return
        if args.command == "model":
            sys.exit(cmd_model_import(args))
        if args.command == "plan":
            cmd_plan(args)
            return
        if args.command in ("run", "agents"):
            (cmd_run if args.command == "run" else cmd_list_agents)(args)
            return
        with StoreClient(args.store, timeout=LISTING_SECONDS, security=_security(args)) as client:
            STORE_COMMANDS[args.store_command][0](client, args)
    except AgentKVError as exc:
        line = _unreachable(exc, args) or f"{type(exc).__name__} ({exc.code.name}): {exc.message}"
        if isinstance(exc, Unauthenticated) and exc.remote:  # the server's word: say the fix
            line += " (give the token: --token-file FILE, or env AGENTKV_TOKEN)"
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        raise  # main's
    except (ValueError, OSError) as exc:  # a bad flag's value: a file, an address, a config
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ServiceExited as exc:  # a service it started (demo, walkthrough): its one line
        said = exc.reason  # "agentkv-worker: error: ..." says whose error it is already
        print(said if ": error: " in said else f"error: {said}", file=sys.stderr)
        sys.exit(2)


# gRPC's reasons for a connection that was made but never became gRPC's: nothing came back
# before its connect timeout (20 s; "Endpoint closing" with TLS), or something not HTTP/2 did.
_NO_ANSWER = ("before receiving SETTINGS frame", "(Endpoint closing)", NOT_HTTP2)
# gRPC's words for a call its client's deadline ended
DEADLINE_WORDS = "Deadline Exceeded"
# the SDK's, once every worker it may route an agent to was tried and none answered
_EXHAUSTED = "no worker could be reached"
# gRPC's words for a host name that does not resolve (its native resolver's; c-ares's)
_UNRESOLVED = ("errors resolving", "DNS resolution failed")


def _too_long(exc: AgentKVError, args: argparse.Namespace) -> str:
    """A call past the deadline --timeout gave it: which service took it, and what became of
    a turn it cut short (the SDK's account: kept with the reply so far, or undone)."""
    workers = _workers(args)
    if exc.peer == "store":
        peer = f"the store at {args.store}"
    else:
        peer = ("the worker at " if len(workers) == 1 else "a worker of ") + ", ".join(workers)
    line = f"a call to {peer} did not end within {args.timeout:g} s: is it hung, or busy? "
    line += "(--timeout SECONDS gives it longer)"
    turn = exc.message.removeprefix(DEADLINE_WORDS).strip()  # "after N tokens of ...", if any
    return f"{line}. It ended {turn}." if turn else line


def _unreachable(exc: AgentKVError, args: argparse.Namespace) -> str | None:
    """For a service nobody listens at: one line naming it and how to point elsewhere; for
    one that took the connection but never answered, or whose TLS did not fit the
    client's, what failed; for a host name that does not resolve, that."""
    unresolved = any(words in exc.message for words in _UNRESOLVED)
    if exc.remote:
        return None
    if isinstance(exc, DeadlineExceeded) and hasattr(args, "timeout"):  # run, agents
        return _too_long(exc, args)
    if not isinstance(exc, Unavailable):
        return None
    if "failed to connect" not in exc.message and not unresolved and _EXHAUSTED not in exc.message:
        return None
    store = args.command == "store" or exc.peer == "store"
    workers = "" if store else ", ".join(_workers(args))  # `agentkv store` has no --worker
    peer = f"the store at {args.store}" if store else f"the worker at {workers}"
    if unresolved:
        flags = "--store / AGENTKV_STORE" if store else "--worker / AGENTKV_WORKERS"
        return f"{peer}: its host name does not resolve (check {flags}; gRPC: {exc.message})"
    # "...; last error: UNKNOWN: ipv4:HOST:PORT: Tls handshake failed (...): ...: OK"
    reason = connect_failure(exc.message)
    if any(words in reason for words in _NO_ANSWER):
        return (
            f"{peer} took the connection but did not answer: is it hung, or not an agentkv "
            f"gRPC server? (gRPC: {reason})"
        )
    if "handshake" in reason.lower():
        return f"TLS with {peer} failed: {reason} (check --tls-ca, --tls-cert, --tls-key)"
    if "Socket closed" in reason and not getattr(args, "tls_ca", ""):
        return f"{peer} closed the connection: does it serve TLS? (then pass --tls-ca)"
    if store:
        return f"no store at {args.store} (start agentkv-store, or pass --store / AGENTKV_STORE)"
    return (
        f"no worker answers at {workers} (start agentkv-worker, or pass --worker / "
        f"AGENTKV_WORKERS): {exc.message}"
    )
