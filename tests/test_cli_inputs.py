"""What the CLI is given and cannot use (an address, a config, a path) is a usage error naming
it, before anything connects; `agentkv agents` lists every agent even when some cannot be
described. From the real CLI, as a user runs it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.helpers import FP, free_address, make_chain


def agentkv(*args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "agentkv.cli", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def no_internals(stderr: str) -> bool:
    return not any(s in stderr for s in ("Traceback", "Source Location", "Failed to create"))


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["store", "stats", "--store", ""], "--store"),
        (["store", "--store", "", "stats"], "--store"),
        (["store", "stats", "--store", "garbage"], "--store"),
        (["store", "stats", "--store", "unix:"], "--store"),
        (["agents", "--store", ""], "--store"),
        (["agents", "--worker", ""], "--worker"),
        (["run", "prisoners_dilemma", "--worker", "127.0.0.1:1", "--worker", "x"], "--worker"),
    ],
    ids=["store-empty", "store-empty-before", "store-garbage", "unix-no-path", "agents-store",
         "agents-worker", "run-worker"],
)  # fmt: skip
def test_a_malformed_address_is_a_usage_error_naming_its_flag(args, flag):
    proc = agentkv(*args)
    assert proc.returncode == 2, proc.stderr
    assert no_internals(proc.stderr), proc.stderr
    assert f"error: argument {flag}: " in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--worker", "foo"], "--worker"),
        (["--worker", ""], "--worker"),
        (["--worker", "127.0.0.1:99999"], "--worker"),  # it dialed port 34463
        (["--worker", "127.0.0.1:1", "--worker", "x"], "--worker"),
        (["--worker", "127.0.0.1:1", "--store", "foo"], "--store"),
    ],
    ids=["worker", "worker-empty", "worker-port", "second-worker", "store"],
)
def test_a_gateway_given_a_malformed_address_refuses_to_start_naming_its_flag(args, flag):
    """As the CLI and the worker refuse theirs: the gateway served, and only logged "worker
    does not answer"."""
    cmd = [sys.executable, "-m", "agentkv.gateway", *args, "--listen", "127.0.0.1:0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"agentkv-gateway: error: {flag}: an address must be "), proc.stderr


@pytest.mark.parametrize(
    ("program", "args", "said"),
    [
        (
            "agentkv.cli",
            ["agents", "--store", "http://127.0.0.1:1"],
            "argument --store: an address is HOST:PORT or unix:PATH, not a http:// URL: "
            "got 'http://127.0.0.1:1' (give 127.0.0.1:1)",
        ),
        ("inference_worker", ["--store", "https://h:1/"], "--store: an address is HOST:PORT"),
        ("agentkv.gateway", ["--worker", "grpc://h:1"], "--worker: an address is HOST:PORT"),
        ("agentkv.cli", ["store"], "required: {stats,namespaces,agents,agent,blocks,verify,gc"),
        ("agentkv.cli", ["model"], "the following arguments are required: {import}"),
        (
            "cache_store",
            ["--data-dir", "d", "--umask", "999"],
            "argument --umask: an octal mode such as 077 or 027, got '999'",
        ),
        ("cache_store", ["--data-dir", "d", "--workers", "1"], "error: --workers must be >= 2"),
        # the reviewer's: a socket bound at /rel.sock, then an address no client could dial
        ("cache_store", ["--data-dir", "d", "--listen", "unix://rel.sock"], "names no socket path"),
        # "::1" was "beyond loopback: needs --auth-tokens", "::1:0" a C-core log line
        ("cache_store", ["--data-dir", "d", "--listen", "::1"], "in brackets, then its port: [::"),
        ("agentkv.cli", ["store", "stats", "--store", "::1:4011"], "in brackets, then its port"),
        ("agentkv.gateway", ["--worker", "h:1", "--listen", "::1:0"], "IPv6 address goes in"),
        (  # "group_size must be positive", the field's name
            "agentkv.cli",
            ["plan", "--context", "8K", "--budget", "1G", "--group-size", "0"],
            "argument --group-size: a whole number of at least 1, got '0'",
        ),
        (  # it cited store_timeout=60.0, which no flag sets
            "inference_worker",
            ["--store", "h:1", "--store-check-timeout", "0"],
            "--store-check-timeout must be over 0 and at most 60 s",
        ),
        (
            "inference_worker",
            ["--store", "h:1", "--max-batch", "0"],
            "error: --max-batch, --step-tokens and --queue-limit must be >= 1",
        ),
        (  # the reviewer's: it failed mid-run, SystemPromptDiffers, the flag it named unknown
            "agentkv.cli",
            ["run", "prisoners_dilemma", "--mode", "cold", "--no-reset"],
            "--mode cold starts every agent from nothing: --no-reset has nothing to keep",
        ),
    ],
    ids=[
        "cli-url",
        "worker-url",
        "gateway-url",
        "store-command",
        "model-command",
        "umask",
        "store-workers",
        "unix-relative",
        "ipv6-no-brackets",
        "cli-ipv6",
        "gateway-ipv6",
        "plan-group-size",
        "worker-check-timeout",
        "worker-batch",
        "cold-no-reset",
    ],
)
def test_usage_errors_name_what_the_user_typed(program, args, said, tmp_path):
    """The red team's: a URL where HOST:PORT belongs was "its host name does not resolve";
    a missing subcommand was named by its dest (store_command), a bad --umask by Python's
    int() ("invalid literal ... base 8"), and a flag's check by its field (hot_budget_bytes)."""
    proc = subprocess.run(
        [sys.executable, "-m", program, *args], capture_output=True, text=True, timeout=60,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert said in proc.stderr.splitlines()[-1], proc.stderr
    assert "_command" not in proc.stderr and "int()" not in proc.stderr


def test_agentkv_gateway_names_the_command_a_user_typed():
    """`agentkv gateway --help` said "usage: agentkv-gateway", and its errors so."""
    helped = agentkv("gateway", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: agentkv gateway ")
    refused = agentkv("gateway", "--worker", "foo", "--listen", "127.0.0.1:0")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines()[-1].startswith("agentkv gateway: error: --worker: ")


def test_a_malformed_address_in_the_environment_names_the_variable():
    proc = agentkv("store", "stats", AGENTKV_STORE="garbage")
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert "error: env AGENTKV_STORE: " in proc.stderr.splitlines()[-1], proc.stderr
    assert proc.stderr.startswith("usage: agentkv store "), proc.stderr  # the command's usage
    proc = agentkv("agents", "--store", free_address(), AGENTKV_WORKERS="127.0.0.1:1,,x")
    assert proc.returncode == 2 and "error: env AGENTKV_WORKERS: " in proc.stderr, proc.stderr
    assert proc.stderr.startswith("usage: agentkv agents "), proc.stderr


def test_a_token_file_from_the_environment_is_named_as_that_variable():
    """AGENTKV_TOKEN_FILE naming no file said "token file /no/such/token: ...", naming
    neither the variable nor the flag, as AGENTKV_TLS_CA's error does."""
    proc = agentkv("agents", "--store", free_address(), AGENTKV_TOKEN_FILE="/no/such/token")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "error: AGENTKV_TOKEN_FILE (--token-file) /no/such/token: no such file or directory\n"
    )


@pytest.mark.parametrize(
    ("program", "args"),
    [
        ("inference_worker", ["--store", "127.0.0.1:1", "--hot-budget", "-1G"]),
        ("cache_store", ["--data-dir", "unused", "--quota", "-5M"]),
        ("agentkv.cli", ["plan", "--context", "8K", "--budget", "-1G"]),
    ],
    ids=["worker", "store", "plan"],
)
def test_a_negative_size_is_refused_as_that_flags_value(program, args):
    """Not argparse's "expected one argument", as if "-1G" were an option."""
    proc = subprocess.run(
        [sys.executable, "-m", program, *args], capture_output=True, text=True, timeout=120
    )
    flag, value = args[-2:]
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert f"error: argument {flag}: " in proc.stderr.splitlines()[-1], proc.stderr
    assert repr(value) in proc.stderr, proc.stderr


def test_an_empty_data_dir_is_a_usage_error_not_the_current_directory(tmp_path):
    """`--data-dir "$DATA"` with DATA unset: the store made its index, blocks and lock in
    the directory it was started from (and swept its tmp/)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cache_store", "--data-dir", "", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert "argument --data-dir: an empty path" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_plan_without_its_figures_is_a_usage_error_of_plan():
    proc = agentkv("plan", "--context", "8K")
    assert proc.returncode == 2 and proc.stderr.startswith("usage: agentkv plan "), proc.stderr
    assert proc.stderr.splitlines()[-1] == "agentkv plan: error: plan needs --context and --budget"


@pytest.mark.parametrize("command", ["plan", "agents", "run", "demo", "walkthrough", "store"])
def test_help_says_each_default_once_and_helps_every_flag(command):
    proc = agentkv(command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert not re.search(r"\(default: [^)]*\) \(default:", text), text
    flags = re.findall(r"^  (-\S+(?: [A-Z_]+)?(?:, --\S+(?: [A-Z_]+)?)?)$", proc.stdout, re.M)
    for line in flags:  # a flag alone on its line: its help is on the next, or missing
        after = proc.stdout.split(line + "\n", 1)[1].splitlines()[0]
        assert after.startswith(" " * 8) and after.strip(), f"{line!r} has no help"


def test_an_empty_address_variable_counts_as_unset():
    nobody = free_address()
    proc = agentkv("agents", "--store", nobody, AGENTKV_WORKERS="")
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert proc.stderr.startswith(f"error: no store at {nobody} "), proc.stderr
    proc = agentkv("store", "stats", AGENTKV_STORE="")  # the default, 127.0.0.1:50051
    assert no_internals(proc.stderr) and "''" not in proc.stderr, proc.stderr
    assert proc.returncode == 0 or "127.0.0.1:50051" in proc.stderr, proc.stderr


def save_agents(store_process, namespace: str, *agent_ids: str) -> None:
    tokens = list(range(64))
    blocks, _ = make_chain(tokens)
    with store_process.client() as client:
        for agent_id in agent_ids:
            client.save_agent(namespace, agent_id, FP, tokens, blocks, phase="yard")


def rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows by agent id, split on runs of two or more spaces."""
    import re

    lines = stdout.splitlines()
    return {
        cells[0]: cells
        for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[2:])
        if cells and cells[0]
    }


def test_agents_lists_every_agent_from_the_store_when_no_worker_answers(store_process):
    save_agents(store_process, "team", "marco", "luca")
    nobody = free_address()
    proc = agentkv("agents", "-n", "team", "--store", store_process.address,
                   "--worker", nobody)  # fmt: skip
    assert proc.returncode == 2, proc.stderr  # the listing is incomplete: its tiers
    listed = rows(proc.stdout)
    assert set(listed) == {"marco", "luca"}, proc.stdout
    for cells in listed.values():
        assert cells[1:3] == ["?", "64"] and "yard" in cells, proc.stdout
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert f"no worker answers at {nobody} (start agentkv-worker, or pass" in proc.stderr


class Hung(grpc.GenericRpcHandler):
    """A worker that takes every call and answers none (hung: its connection answers pings,
    so only a deadline ends a call) until `released`."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def service(self, handler_call_details):
        def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.released.wait(120)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

        return grpc.unary_unary_rpc_method_handler(hold)


def test_agents_against_a_hung_worker_ends_at_its_timeout(store_process):
    """A worker that took the listing's calls and answered none kept `agentkv agents`
    waiting for the SDK's deadline, five minutes. The listing's calls get 60 s (--timeout):
    it lists what the store has, and says why the tiers are missing."""
    save_agents(store_process, "team", "marco", "luca")
    hung = Hung()
    server = grpc.server(ThreadPoolExecutor(4), handlers=[hung])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = agentkv("agents", "-n", "team", "--store", store_process.address,
                       "--worker", f"127.0.0.1:{port}", "--timeout", "5")  # fmt: skip
    finally:
        hung.released.set()
        server.stop(None)
    assert proc.returncode == 2, proc.stderr  # the listing is incomplete: its tiers
    listed = rows(proc.stdout)
    assert set(listed) == {"marco", "luca"}, proc.stdout
    assert all(cells[1:3] == ["?", "64"] for cells in listed.values()), proc.stdout
    assert proc.stderr.count("\n") == 1 and no_internals(proc.stderr), proc.stderr
    assert proc.stderr == (
        f"error: a call to the worker at 127.0.0.1:{port} did not end within 5 s: is it hung, "
        "or busy? (--timeout SECONDS gives it longer)\n"
    )


def test_a_turn_past_its_deadline_says_what_became_of_it_and_other_commands_as_they_were():
    """`run`'s line keeps the SDK's account of a turn its deadline cut (kept or undone) and
    names all the workers it may have gone to; a command without --worker or --timeout (demo,
    walkthrough, store) gets its error's own line, as before (reading --worker there raised
    AttributeError)."""
    from agentkv.cli import _unreachable
    from agentkv.errors import DeadlineExceeded, Unavailable

    args = argparse.Namespace(command="run", worker=["a:1", "b:2"], store="s:3", timeout=300.0)
    cut = "Deadline Exceeded after 3 tokens of the reply of Agent('x'): its worker keeps the turn"
    assert _unreachable(DeadlineExceeded(cut), args) == (
        "a call to a worker of a:1, b:2 did not end within 300 s: is it hung, or busy? "
        "(--timeout SECONDS gives it longer). It ended after 3 tokens of the reply of "
        "Agent('x'): its worker keeps the turn."
    )
    for command in ("demo", "walkthrough", "store"):
        args = argparse.Namespace(command=command, store="s:3")
        for exc in (DeadlineExceeded("Deadline Exceeded"), Unavailable("Socket closed")):
            assert _unreachable(exc, args) is None


def test_agents_shows_an_agent_of_another_model_in_its_own_row(
    tiny_model_dirs, store_process, start_worker
):
    from agentkv.client.memory import AgentMemory

    worker = start_worker(tiny_model_dirs["llama"])
    with AgentMemory(worker.address, store=store_process.address, namespace="team") as mem:
        mem.agent("marco", system="You are Marco.")
    save_agents(store_process, "team", "stranger")  # written under another fingerprint
    proc = agentkv("agents", "-n", "team", "--store", store_process.address,
                   "--worker", worker.address)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    listed = rows(proc.stdout)
    assert listed["marco"][1] == "hot", proc.stdout
    assert listed["stranger"][1:3] == ["other model", "64"], proc.stdout
    # The SDK's listings, sync and asyncio, show it the same way rather than failing whole
    # (they raised FingerprintMismatch, and the gateway's /v1/agents answered 409).
    from agentkv.client.aio import AsyncAgentMemory

    async def listed_async() -> list:
        async with AsyncAgentMemory(worker.address, store=store_process.address,
                                    namespace="team") as mem:  # fmt: skip
            return await mem.agents()

    with AgentMemory(worker.address, store=store_process.address, namespace="team") as mem:
        for states in (mem.agents(), asyncio.run(listed_async())):
            tiers = {s.agent_id: (s.tier, s.num_tokens) for s in states}
            assert tiers == {"marco": ("hot", tiers["marco"][1]), "stranger": ("other model", 64)}


def test_plan_with_a_model_type_that_is_not_a_string_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": ["llama"]}))
    proc = agentkv("plan", "--config", str(tmp_path), "--context", "8K", "--budget", "1G")
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "model_type ['llama']" in proc.stderr


def test_bench_out_naming_a_file_is_a_usage_error(tmp_path):
    report = tmp_path / "report"
    report.write_text("mine")
    proc = agentkv("bench", "--only", "capacity", "--out", str(report))
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("agentkv bench: error: --out "), proc.stderr
    assert report.read_text() == "mine"


def laughs(levels: int) -> str:
    """A list holding 10 of the list before it, `levels` deep: 10^levels 'ha's."""
    value = "&l0 [" + ", ".join(["ha"] * 10) + "]"
    for i in range(1, levels):
        value = f"&l{i} [" + ", ".join([value] + [f"*l{i - 1}"] * 9) + "]"
    return value


def merges(levels: int) -> str:
    """Mappings each merging the one before twice: 2^levels keys to copy."""
    lines = ["m0: &m0 {a: 1}"]
    lines += [f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}]}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


ONE_TURN = "agents: [{id: a}]\nphases: [{name: p, turns: [{agent: a, say: hi}]}]\n"


@pytest.mark.parametrize(
    "text",
    [
        f"name: laughs\nsampling: {{stop: {laughs(6)}}}\n{ONE_TURN}",
        f"name: merges\n{merges(20)}{ONE_TURN}",
        f"name: itself\nsampling: {{stop: &me [a, *me]}}\n{ONE_TURN}",
    ],
    ids=["nested-lists", "merge-keys", "a-list-in-itself"],
)
def test_a_scenario_its_aliases_expand_past_1_mib_is_refused_in_one_line(tmp_path, text):
    """Under 1 MiB, the file's aliases repeat a value past it written out ("billion laughs"):
    refused at load, naming the file. It loaded: its error line showed the million 'ha's
    (6 MB; 9 levels, 6 GB), merge keys copied a million keys, a list in itself was shown."""
    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    assert path.stat().st_size < 1000
    proc = agentkv("run", str(path), "--worker", free_address(), "--store", free_address())
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and len(proc.stderr) < 300, proc.stderr[-2000:]
    assert f"{path}: its aliases (*name) repeat so much " in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ("phases: [{name: p, turns: [{agent: a, say: hi}, {agent: a, say: go, "
         "max_tokens: 1000000000}]}]", "phases[0].turns[1].max_tokens"),
        ("sampling: {max_tokens: 1000000000}\nphases: [{name: p, turns: [{agent: a, say: hi}]}]",
         "sampling.max_tokens"),
    ],
    ids=["a-turn", "the-scenario"],
)  # fmt: skip
def test_max_tokens_past_what_an_agent_holds_is_refused_at_load_naming_it(tmp_path, change, where):
    """A billion tokens, more than any model's context: it was accepted, the run starting (and
    deleting the scenario's agents) before the worker refused the turn."""
    path = tmp_path / "long.yaml"
    path.write_text(f"name: long\nagents: [{{id: a}}]\n{change}\n")
    proc = agentkv("run", str(path), "--worker", free_address(), "--store", free_address())
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"{path}: {where}: 1000000000 is more than an agent can hold: " in proc.stderr


def test_a_reader_that_leaves_ends_the_cli_quietly_as_a_pipe_does():
    """`agentkv ... | head -1`: the reader closes the pipe before the CLI writes. It said
    "error: [Errno 32] Broken pipe" and exit 2, as if its input were wrong; now it ends
    silently with 141 (128 + SIGPIPE), as a shell reports any writer cut off so."""
    cmd = [sys.executable, "-m", "agentkv.cli", "plan", "--context", "8K", "--budget", "1G"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before it writes: the only reader is gone
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 141, stderr
    assert stderr == b""


def test_a_run_whose_agent_another_run_deleted_says_to_give_each_its_own_namespace(
    monkeypatch, capsys
):
    """The reviewer's: two `agentkv run`s of one scenario in one namespace, the second's
    reset deleting the first's agents mid-run: the first ended "AgentNotFound: agent
    'warden' not found in namespace 'prisoners'", an agent it had just made. (In one
    process: the deletion must land mid-run.)"""
    from agentkv import cli
    from agentkv.client import scenario
    from agentkv.errors import AgentNotFound

    def deleted_meanwhile(*args, **kwargs):
        gone = AgentNotFound("agent 'warden' not found in namespace 'prisoners'")
        gone.remote = True  # the worker's word
        raise gone

    monkeypatch.setattr(scenario, "run_scenario", deleted_meanwhile)
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "prisoners_dilemma", "--store", "127.0.0.1:1", "--worker", "127.0.0.1:2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert "another agentkv run in namespace 'prisoners'? (give each its own -n NAME)" in err
