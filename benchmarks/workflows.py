"""Workflow benchmark: cross-phase persistence (the paper's Table 7) and expert routing (Table 8).

The SDK's workflows on a real store and worker; the README explains the method.
Run: python benchmarks/workflows.py [--model SPEC] [--passes 5] [--routing-passes 3]
[--max-tokens 64] [--quick] [--out DIR]
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import harness as h
from paper import TABLE7, TABLE8

from agentkv.client.demo import scenario_path
from agentkv.client.memory import AgentMemory
from agentkv.client.scenario import Scenario, load_scenario, run_scenario
from agentkv.client.workflow import Record

MODES = ("cold", "persistent")
QUICK_DOCUMENT_CHARS = 2000  # --quick caps every expert document (about 500 tokens)
QUICK_MAX_TOKENS = 8  # --quick's replies, in both scenarios
CHAT_OVERHEAD = 64  # tokens a turn's template and prompt add around a document, generously
TARGET_PHASE, TARGET_RATIO = 5, TABLE7["Gemma 3"][4][2]
TARGET_SPEEDUP = 24.0  # the paper: "24x warm/cold" (Gemma 3, 24.2x)
GROUPS = {  # routing's rows: (table row, chart label, TABLE8 row, TABLE8 speedup)
    "priming": ("priming (cold: document prefilled in the turn)", "priming\n(cold)", "priming", ""),
    "queries_warm": ("queries, first touch (warm)", "queries\n(warm)", "queries", "warm"),
    "queries_hot": ("queries, expert asked again (hot)", "queries again\n(hot)", "", ""),
    "reporter": ("reporter turns", "reporter", "", ""),
    "repeated": ("repeated (hot)", "repeated\n(hot)", "repeated", "hot"),
    "other": ("unexpected cache state", "other", "", ""),
}


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ratio_range(values: Sequence[float]) -> str:
    """Per-pass ratios as min-max, times."""
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "-"


def run_pass(svc: Any, scenario: Scenario, namespace: str, mode: str = "persistent") -> list:
    """One run of the scenario in a fresh namespace; every agent it left is deleted after."""
    with AgentMemory(svc.addresses["worker"], svc.store_address, namespace) as mem:
        flow = run_scenario(scenario, mem, mode=mode)
        for role in scenario.roles:
            mem.agent(role.id).delete()
    return flow.records


def warm_up(svc: Any, prisoners: Scenario, experts: Scenario, full: bool) -> None:
    """Untimed: one prisoner's run per mode (unless not `full`: --quick skips them), one
    expert primed, evicted and asked again."""
    for mode in MODES if full else ():
        run_pass(svc, prisoners, f"warmup-{mode}", mode)
    priming, queries = experts.phases[0], experts.phases[1]
    expert = queries.turns[0].agent
    phases = (
        dataclasses.replace(priming, turns=tuple(t for t in priming.turns if t.agent == expert)),
        dataclasses.replace(queries, turns=queries.turns[:1]),
    )
    run_pass(svc, dataclasses.replace(experts, phases=phases), "warmup-experts")


@dataclass(slots=True)
class PhaseCell:
    """One phase of one pass in one mode."""

    ttft: float | None  # mean over the phase's turns
    setup: float | None  # mean create/inject call ms
    incl_setup: float | None  # mean over speakers of (their setup ms + first turn ttft)
    prefilled: float | None  # mean tokens a turn prefilled
    context: float | None  # mean context tokens at a turn
    generated: float | None


def phase_cell(records: list[Record], phase: str) -> PhaseCell:
    says = [r for r in records if r.phase == phase and r.kind == "say"]
    setup = [r for r in records if r.phase == phase and r.kind != "say"]
    first: dict[str, float] = {}
    for r in says:
        first.setdefault(r.agent, r.ms)
    incl = [ms + sum(s.ms for s in setup if s.agent == agent) for agent, ms in first.items()]
    of = lambda name: mean([getattr(r, name) for r in says])  # noqa: E731
    setup_ms = mean([r.ms for r in setup])
    tokens = map(of, ("prefilled_tokens", "context_tokens", "generated_tokens"))
    return PhaseCell(of("ms"), setup_ms, mean(incl), *tokens)


@dataclass(slots=True)
class CrossPhase:
    phases: list[str]
    passes: list[dict[str, list[Record]]] = field(default_factory=list)  # by mode

    def cells(self, mode: str, phase: str) -> list[PhaseCell]:
        return [phase_cell(p[mode], phase) for p in self.passes]

    def med(self, mode: str, phase: str, attr: str = "ttft") -> float | None:
        return h.median([getattr(c, attr) for c in self.cells(mode, phase)])

    def ratio(self, phase: str, attr: str = "ttft") -> float | None:
        """Median cold ttft over median persistent `attr`."""
        return div(self.med("cold", phase), self.med("persistent", phase, attr))

    def ratios(self, phase: str) -> list[float]:
        """Per pass: cold ttft / persistent ttft."""
        pairs = zip(self.cells("cold", phase), self.cells("persistent", phase), strict=True)
        return [r for c, p in pairs if (r := div(c.ttft, p.ttft)) is not None]


def cross_phase(svc: Any, scenario: Scenario, passes: int) -> CrossPhase:
    """--passes of each mode, alternating which runs first."""
    result = CrossPhase([p.name for p in scenario.phases])
    for i in range(passes):
        records: dict[str, list[Record]] = {}
        for mode in MODES if i % 2 else reversed(MODES):
            started = time.perf_counter()
            records[mode] = run_pass(svc, scenario, f"{scenario.namespace}-{mode}-p{i}", mode)
            took = time.perf_counter() - started
            h.say(f"cross-phase pass {i + 1}/{passes} {mode}: {took:.1f} s")
        result.passes.append(records)
    return result


def group_of(record: Record, experts: set[str]) -> str | None:
    """The Table 8 row a turn belongs to (None: not a turn)."""
    if record.kind != "say":
        return None
    if record.agent not in experts:
        return "reporter"
    if record.phase == "priming":
        return "priming"
    if record.phase == "repeated":
        return "repeated" if record.cache_state == "hot" else "other"
    return {"warm": "queries_warm", "hot": "queries_hot"}.get(record.cache_state, "other")


@dataclass(slots=True)
class Routing:
    experts: set[str]
    passes: list[list[Record]] = field(default_factory=list)

    def records(self, group: str) -> list[list[Record]]:
        return [[r for r in p if group_of(r, self.experts) == group] for p in self.passes]

    def every(self, group: str) -> list[Record]:
        return [r for rs in self.records(group) for r in rs]

    def pass_means(self, group: str) -> list[float | None]:
        return [mean([r.ms for r in rs]) for rs in self.records(group)]

    def pass_mean(self, group: str) -> float | None:
        """The median over passes of each pass's mean TTFT."""
        return h.median(self.pass_means(group))

    def speedups(self, group: str) -> list[float]:
        """Per pass: mean priming TTFT / mean `group` TTFT."""
        pairs = zip(self.pass_means("priming"), self.pass_means(group), strict=True)
        return [r for cold, other in pairs if (r := div(cold, other)) is not None]

    def speedup(self, group: str) -> float | None:
        return div(self.pass_mean("priming"), self.pass_mean(group))


def routing(svc: Any, scenario: Scenario, passes: int) -> Routing:
    result = Routing({r.id for r in scenario.roles if r.document})
    for i in range(passes):
        started = time.perf_counter()
        result.passes.append(run_pass(svc, scenario, f"{scenario.namespace}-p{i}"))
        h.say(f"routing pass {i + 1}/{passes}: {time.perf_counter() - started:.1f} s")
    return result


def check_fit(tokenizer: Any, scenario: Scenario, window: int, max_tokens: int) -> str:
    """Refuses documents that cannot fit the model's context; says how they fit."""
    docs = [len(tokenizer.encode(r.document).ids) for r in scenario.roles if r.document]
    need = max(docs) + CHAT_OVERHEAD + 8 * scenario.sampling.get("max_tokens", 64)
    if need > min(window, max_tokens):
        h.usage_error(f"expert documents need up to ~{need} tokens; the model allows {window}")
    spread = f"{min(docs)}-{max(docs)} tokens (mean {statistics.fmean(docs):.0f})"
    return f"expert documents: {spread}; model window {window}, worker max_context {max_tokens}"


# reporting


def cross_table(cp: CrossPhase) -> str:
    paper = {f"paper {k} cold / pers / x": r for k, r in TABLE7.items()}
    spec = {
        "phase": lambda n: f"{n + 1}: {cp.phases[n]}",
        "cold ttft ms": lambda n: h.fmt(cp.med("cold", cp.phases[n])),
        "persistent ttft ms": lambda n: h.fmt(cp.med("persistent", cp.phases[n])),
        "cold/persistent": lambda n: times(cp.ratio(cp.phases[n])),
        "per pass": lambda n: ratio_range(cp.ratios(cp.phases[n])),
        "persistent create/inject ms": lambda n: h.fmt(cp.med("persistent", cp.phases[n], "setup")),
        "persistent incl. setup ms": lambda n: h.fmt(
            cp.med("persistent", cp.phases[n], "incl_setup")
        ),
        "cold/(incl. setup)": lambda n: times(cp.ratio(cp.phases[n], "incl_setup")),
        "prefilled/turn cold / pers": lambda n: " / ".join(
            h.fmt(cp.med(m, cp.phases[n], "prefilled"), 0) for m in MODES
        ),
        **{k: lambda n, r=r: " / ".join(map(str, r[n])) + "x" for k, r in paper.items()},
    }
    return h.columns(range(len(cp.phases)), spec, "l" + "r" * 8 + "ll")


def routing_table(rt: Routing) -> str:
    spec = {
        "phase group": lambda g: GROUPS[g][0],
        "turns/pass": lambda g: h.fmt(h.median([len(rs) for rs in rt.records(g)]), 0),
        "cache states": lambda g: " ".join(sorted({r.cache_state for r in rt.every(g)})) or "-",
        "mean ttft ms": lambda g: h.fmt(rt.pass_mean(g)),
        "median ttft ms": lambda g: h.fmt(h.median([r.ms for r in rt.every(g)])),
        "prefilled/turn": lambda g: h.fmt(mean([r.prefilled_tokens for r in rt.every(g)]), 0),
        "context tokens": lambda g: h.fmt(mean([r.context_tokens for r in rt.every(g)]), 0),
        "speedup: priming / this (per pass)": lambda g: (
            "-" if g == "priming" else (f"{times(rt.speedup(g))} ({ratio_range(rt.speedups(g))})")
        ),
    }
    for model, v in TABLE8.items():
        spec[f"paper {model} ms"] = lambda g, v=v: v[GROUPS[g][2]] if GROUPS[g][2] else "-"
        spec[f"paper {model} speedup"] = lambda g, v=v: (
            f"{v[GROUPS[g][3]]}x" if GROUPS[g][3] else "-"
        )
    groups = [g for g in GROUPS if g != "other" or rt.every(g)]
    return h.columns(groups, spec, "lrl" + "r" * 9)


def targets(cp: CrossPhase, rt: Routing) -> list[dict[str, Any]]:
    goals = []
    if len(cp.phases) >= TARGET_PHASE:
        phase = cp.phases[TARGET_PHASE - 1]
        for attr, what in (("ttft", "persistent"), ("incl_setup", "persistent incl. setup")):
            cold, pers = cp.med("cold", phase), cp.med("persistent", phase, attr)
            ratio = div(cold, pers) or 0.0
            target = f"phase {TARGET_PHASE} ({phase}) cold/{what} TTFT >= {TARGET_RATIO}x"
            measured = f"{ratio:.2f}x ({h.fmt(cold)} vs {h.fmt(pers)} ms)"
            goals.append(h.goal(target + " (paper, Gemma 3)", measured, ratio >= TARGET_RATIO))
    cold, warm = rt.pass_mean("priming"), rt.pass_mean("queries_warm")
    ratio = div(cold, warm) or 0.0
    target = f"expert routing warm/cold TTFT speedup >= {TARGET_SPEEDUP:.0f}x (paper: 24.2x)"
    measured = f"{ratio:.1f}x ({h.fmt(cold)} vs {h.fmt(warm)} ms)"
    return [*goals, h.goal(target, measured, ratio >= TARGET_SPEEDUP)]


def notes_for(cp: CrossPhase, rt: Routing, fit: str, max_tokens: int) -> list[str]:
    last, n = cp.phases[-1], len(cp.phases)
    context, generated = (cp.med("persistent", last, k) for k in ("context", "generated"))
    notes = [
        fit,
        f"cross-phase: persistent context at phase {n} is {h.fmt(context, 0)} tokens per "
        f"turn; replies average {h.fmt(generated)} tokens of max_tokens {max_tokens}",
    ]
    if other := rt.every("other"):
        unexpected = sorted({f"{r.phase}/{r.agent}:{r.cache_state}" for r in other})
        notes.append(f"routing: unexpected cache states: {', '.join(unexpected)}")
    return notes


LINES = (
    ("cold", "ttft", "o-", "cold (re-prefill)"),
    ("persistent", "ttft", "s-", "persistent"),
    ("persistent", "incl_setup", "s--", "persistent incl. create/inject"),
)


def draw(cp: CrossPhase, rt: Routing, axes: Any) -> None:
    """Per-phase TTFT cold vs persistent, and the routing groups."""
    left, right = axes
    xs = range(1, len(cp.phases) + 1)
    for mode, attr, style, name in LINES:
        ys = [cp.med(mode, phase, attr) for phase in cp.phases]
        left.plot(xs, [float("nan") if y is None else y for y in ys], style, label=name)
    left.set_xticks(list(xs), [f"{n}: {p}" for n, p in zip(xs, cp.phases, strict=True)])
    left.set(ylabel="mean TTFT per phase, ms (median of passes)", title="prisoner's dilemma")
    left.legend(fontsize=7)
    keys = [k for k in GROUPS if rt.every(k)]
    right.bar(range(len(keys)), [rt.pass_mean(k) or 0.0 for k in keys])
    right.set_xticks(range(len(keys)), [GROUPS[k][1] for k in keys], fontsize=7)
    right.set(yscale="log", ylabel="mean TTFT, ms (median of passes)", title="expert routing")


def write_report(cp: CrossPhase, rt: Routing, args: Any, fit: str) -> None:
    info = args.info
    header = h.machine(
        blas=info.blas,
        model=args.model,
        model_dir=args.described,
        device=info.device,
        max_context=info.max_context,
        kv_format=info.kv_format,
        max_tokens=args.max_tokens,
        passes=args.passes,
        routing_passes=args.routing_passes,
    )
    title = f"cross-phase, prisoner's dilemma (Table 7 form; {len(cp.passes)} passes, medians)"
    sections = [
        (title, cross_table(cp)),
        (f"expert routing (Table 8 form; {len(rt.passes)} passes)", routing_table(rt)),
    ]
    phases = {phase: {m: cp.cells(m, phase) for m in MODES} for phase in cp.phases}
    groups = {g: {"pass_means_ms": rt.pass_means(g), "speedups": rt.speedups(g)} for g in GROUPS}
    document = {
        "cross_phase": {"phases": phases, "passes": cp.passes},
        "routing": {"groups": groups, "passes": rt.passes},
    }
    notes = notes_for(cp, rt, fit, args.max_tokens)
    png = h.report("workflows", args.out, header, sections, targets(cp, rt), notes, document)
    h.plot(png, header, "workflows", draw, cp, rt, ncols=2, figsize=(13, 4.8))


def parse_args(argv: list[str] | None) -> Any:
    quick = {"passes": 1, "routing_passes": 1, "max_tokens": QUICK_MAX_TOKENS}
    about = "a smoke run, no prisoners' warm-up, short documents"
    p = h.parser(__doc__, passes=5, quick=quick, quick_help=about)
    p.add_argument("--routing-passes", type=int, default=3, help="expert routing passes")
    p.add_argument("--max-tokens", type=int, default=64, help="cross-phase replies' max_tokens")
    args = p.parse_args(argv)
    if min(args.passes, args.routing_passes, args.max_tokens) < 1:
        p.error("--passes, --routing-passes and --max-tokens must be at least 1")
    return args


def scenario(name: str, max_tokens: int | None, document_chars: int | None = None) -> Scenario:
    """A shipped scenario, its replies up to `max_tokens` (None: the scenario's own)."""
    loaded = load_scenario(scenario_path(name), document_chars)
    sampling = loaded.sampling | ({"max_tokens": max_tokens} if max_tokens else {})
    return dataclasses.replace(loaded, sampling=sampling)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prisoners = scenario("prisoners_dilemma", args.max_tokens)
    quick = (QUICK_MAX_TOKENS, QUICK_DOCUMENT_CHARS) if args.quick else (None, None)
    experts = scenario("expert_routing", *quick)
    tokenizer = h.open_model(args)
    with h.services(None, args.path, {"worker": []}) as svc:
        args.info = info = svc.info["worker"]
        fit = check_fit(tokenizer, experts, h.max_context(args.path), info.max_context)
        h.say(f"store and worker up ({info.blas}, {info.device}); {fit}; warming up")
        warm_up(svc, prisoners, experts, full=not args.quick)
        cp = cross_phase(svc, prisoners, args.passes)
        rt = routing(svc, experts, args.routing_passes)
    write_report(cp, rt, args, fit)


if __name__ == "__main__":
    main()
