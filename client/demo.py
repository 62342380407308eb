"""The demo: a multi-phase workflow whose agents keep their KV caches across phases.

1. Starts `agentkv-store` and `agentkv-worker` (the shipped model) as separate processes.
2. Runs the prisoner's dilemma scenario (client/scenarios/prisoners_dilemma.yaml): a warden
   and two prisoners carry their caches through 5 phases; an analyst appears in phase 5.
   Every turn prints its time to first token and where the agent's cache was.
3. Restarts the worker and runs one more phase: every agent resumes warm from the store.
4. Runs the same scenario with caches cleared every phase (re-prefill, the paper's
   baseline) and compares time to first token phase by phase.
"""

from __future__ import annotations

import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from agentkv import defaults
from agentkv.client.memory import AgentMemory
from agentkv.client.scenario import (
    PhaseSpec,
    Scenario,
    ScenarioError,
    Turn,
    load_scenario,
    run_scenario,
)
from agentkv.client.workflow import Record, Workflow
from agentkv.launch import ServiceProcess, running, store_process, worker_process
from agentkv.units import human_bytes, table

EPILOGUE = PhaseSpec(
    "epilogue",
    "A year has passed. The warden visits the prisoners once more.",
    (
        Turn("warden", "In one sentence, ask each prisoner what they learned."),
        Turn("alice", "Answer the warden in one or two sentences."),
        Turn("bob", "Answer the warden in one or two sentences."),
    ),
)


def scenario_path(name: str) -> Path:
    """A shipped scenario by name (e.g. "prisoners_dilemma"), or a path as given; neither
    there is a ScenarioError naming the shipped ones."""
    scenarios = resources.files("agentkv.client") / "scenarios"
    if (shipped := scenarios / f"{name}.yaml").is_file():
        return Path(str(shipped))
    if not Path(name).exists():
        names = sorted(p.name[:-5] for p in scenarios.iterdir() if p.name.endswith(".yaml"))
        raise ScenarioError(
            f"{name}: cannot read: no such file, nor a shipped scenario ({', '.join(names)})"
        )
    return Path(name)


@contextmanager
def progress(label: str) -> Iterator[None]:
    """Shows a long step while it runs, then how long it took."""
    print(f"  {label} ...", end="", flush=True)
    started = time.perf_counter()
    try:
        yield
    except KeyboardInterrupt:  # the CLI says "interrupted", on a line of its own
        print(flush=True)
        raise
    except BaseException:
        print(" failed", flush=True)
        raise
    print(f" {time.perf_counter() - started:.1f} s", flush=True)


def print_record(record: Record) -> None:
    verb = f"{record.kind:<6}"
    timing = "ttft" if record.kind == "say" else "call"
    text = " ".join(record.text.split())[:48]
    print(
        f"    {verb} {record.agent:<8} {record.cache_state:<4}  {timing} {record.ms:7.1f} ms  "
        f"prefilled {record.prefilled_tokens:4d} of {record.context_tokens:4d}  {text}"
    )


def phase_summary(persistent: Workflow, cold: Workflow | None) -> str:
    """Per phase: mean time to first token of its turns, persistent against cold."""
    rows = []
    for phase in dict.fromkeys(r.phase for r in persistent.records):
        records = [r for r in persistent.records if r.phase == phase]
        says = [r for r in records if r.kind == "say"]
        ttft = statistics.mean(r.ms for r in says)
        setup = [r.ms for r in records if r.kind != "say"]
        row = [
            phase,
            len(says),
            " ".join(sorted({r.cache_state for r in records})),
            f"{ttft:.1f}",
            f"{statistics.mean(setup):.1f}" if setup else "-",
            sum(r.prefilled_tokens for r in records),
        ]
        cold_says = [r for r in cold.records if r.phase == phase] if cold else []
        if cold_says:
            cold_ttft = statistics.mean(r.ms for r in cold_says)
            row += [
                f"{cold_ttft:.1f}",
                sum(r.prefilled_tokens for r in cold_says),
                f"{cold_ttft / ttft:.1f}x",
            ]
        elif cold is not None:
            row += ["-", "-", "-"]
        rows.append(row)
    headers = ["phase", "turns", "cache", "ttft ms", "create/inject ms", "prefilled"]
    if cold is not None:
        headers += ["cold ttft ms", "cold prefilled", "cold/persistent"]
    return table(headers, rows)


def run(model: str = defaults.MODEL, keep: bool = False, cold: bool = True) -> None:
    scenario = load_scenario(scenario_path("prisoners_dilemma"))
    root = Path(tempfile.mkdtemp(prefix="agentkv-demo-"))
    print(f"agentkv demo: {scenario.description}\nmodel {model}, data in {root}\n")
    services: dict[str, ServiceProcess] = {}
    with running(services, root, keep):
        flow = _persistent_run(scenario, model, root, services)
        baseline = None
        if cold:
            worker, store = services["worker"], services["store"]
            with (
                progress("the same scenario with caches cleared every phase (re-prefill)"),
                AgentMemory(worker.address, store.address, f"{scenario.namespace}-cold") as mem,
            ):
                baseline = run_scenario(scenario, mem, mode="cold")
        print("\nper phase (mean time to first token of the phase's turns):")
        print(phase_summary(flow, baseline))


def _persistent_run(
    scenario: Scenario, model: str, root: Path, services: dict[str, ServiceProcess]
) -> Workflow:
    """The scenario, then a worker restart and the epilogue resumed warm from the store;
    `services` holds what is running, for the caller to stop."""
    listen = f"127.0.0.1:{free_port()}"  # a restarted worker comes back at the same address
    with progress("starting agentkv-store"):
        store = services["store"] = store_process(
            root / "data", root / "store.log", own_session=True
        )
        store.start()  # in `services` first: stopped, however its start ends
    with progress(f"starting agentkv-worker (loading {Path(model).name})"):
        worker = services["worker"] = worker_process(
            model, store.address, root / "worker.log", listen, own_session=True
        )
        worker.start()
    print(f"  store pid {store.proc.pid} on {store.address}")
    print(f"  worker pid {worker.proc.pid} on {worker.address}\n")
    with AgentMemory(worker.address, store.address, scenario.namespace) as mem:
        flow = run_scenario(
            scenario, mem, on_record=print_record, on_phase=lambda name: print(f"  phase {name}")
        )
        print("\nrestarting the worker: its RAM is gone, the store keeps every cache")
        worker.stop()
        with progress("starting a new agentkv-worker"):
            worker = services["worker"] = worker_process(
                model, store.address, root / "worker.log", listen, own_session=True
            )
            worker.start()
        print(f"  phase {EPILOGUE.name}")
        run_scenario(scenario, mem, workflow=flow, phases=(EPILOGUE,))
        resumed = [r for r in flow.records if r.phase == EPILOGUE.name]
        warm = sorted({r.agent for r in resumed if r.cache_state == "warm"})
        print(f"  resumed warm from the store: {', '.join(warm)}")
        print("\nagents now:")
        rows = [
            [a.agent_id, a.tier, a.num_tokens, human_bytes(a.num_bytes), a.phase]
            for a in mem.agents()
        ]
        print(table(["agent", "tier", "tokens", "bytes", "phase"], rows))
    return flow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    run(sys.argv[1] if len(sys.argv) > 1 else defaults.MODEL)


if __name__ == "__main__":
    main()
