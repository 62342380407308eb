"""Workflow benchmark: cross-phase persistence (the paper's Table 7) and expert routing (Table 8).

The prisoner's dilemma, persistent against cold, and expert routing (priming cold, queries
warm and hot), through the SDK's workflows on a real store and worker; the README explains the
method. Run: python benchmarks/workflows.py [--model SPEC] [--passes 5] [--routing-passes 3]
[--max-tokens 64] [--only cross-phase|routing] [--quick] [--out DIR]
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import describe_model, load_tokenizer, model_dir
from harness import fmt, machine, median, parser, plot, report, say, services, table
from paper import TABLE7, TABLE8

from agentkv.client.demo import scenario_path
from agentkv.client.memory import AgentMemory
from agentkv.client.scenario import Scenario, load_scenario, run_scenario
from agentkv.client.worker import WorkerClient
from agentkv.client.workflow import Record

MODES = ("cold", "persistent")
QUICK_DOCUMENT_CHARS = 2000  # --quick caps every expert document (about 500 tokens)
QUICK_MAX_TOKENS = 8  # --quick's replies, in both scenarios
CHAT_OVERHEAD = 64  # tokens a turn's template and prompt add around a document, generously
TARGET_PHASE, TARGET_RATIO = 5, TABLE7["Gemma 3"][4][2]
TARGET_SPEEDUP = 24.0  # the paper: "24x warm/cold" (Gemma 3, 24.2x)
GROUPS = (  # key, table row, chart label
    ("priming", "priming (cold: document prefilled in the turn)", "priming\n(cold)"),
    ("queries_warm", "queries, first touch (warm)", "queries\n(warm)"),
    ("queries_hot", "queries, expert asked again (hot)", "queries again\n(hot)"),
    ("reporter", "reporter turns", "reporter"),
    ("repeated", "repeated (hot)", "repeated\n(hot)"),
    ("other", "unexpected cache state", "other"),
)


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# the processes


@dataclass(slots=True)
class Services:
    worker: str
    store: str
    info: Any  # the worker's GetWorkerInfoResponse


def hot_agents(svc: Services) -> int:
    with WorkerClient(svc.worker) as client:
        return client.info().num_hot_agents


def run_pass(
    svc: Services, scenario: Scenario, namespace: str, mode: str = "persistent"
) -> list[Record]:
    """One run of the scenario in a fresh namespace; every agent it left is deleted after."""
    with AgentMemory(svc.worker, svc.store, namespace) as mem:
        flow = run_scenario(scenario, mem, mode=mode)
        for role in scenario.roles:
            mem.agent(role.id).delete()
    return flow.records


def warm_up(svc: Services, prisoners: Scenario, experts: Scenario, full: bool = True) -> None:
    """Untimed: one prisoner's run per mode (unless not `full`: --quick, a smoke run, skips
    them), one expert primed, evicted and asked again."""
    for mode in MODES if full else ():
        run_pass(svc, prisoners, f"warmup-{mode}", mode)
    priming, queries = experts.phases[0], experts.phases[1]
    expert = queries.turns[0].agent
    phases = (
        dataclasses.replace(priming, turns=tuple(t for t in priming.turns if t.agent == expert)),
        dataclasses.replace(queries, turns=queries.turns[:1]),
    )
    run_pass(svc, dataclasses.replace(experts, phases=phases), "warmup-experts")


# cross-phase


@dataclass(slots=True)
class PhaseCell:
    """One phase of one pass in one mode."""

    ttft: float | None  # mean over the phase's turns
    first_ttft: float | None  # mean over speakers of their first turn in the phase
    setup: float | None  # mean create/inject call ms
    incl_setup: float | None  # mean over speakers of (their setup ms + first turn ttft)
    turns: int
    prefilled: float | None  # mean tokens a turn prefilled
    setup_prefilled: int
    context: float | None  # mean context tokens at a turn
    generated: float | None
    states: list[str]


def phase_cell(records: list[Record], phase: str) -> PhaseCell:
    says = [r for r in records if r.phase == phase and r.kind == "say"]
    setup = [r for r in records if r.phase == phase and r.kind != "say"]
    first: dict[str, float] = {}
    for r in says:
        first.setdefault(r.agent, r.ms)
    incl = [ms + sum(s.ms for s in setup if s.agent == agent) for agent, ms in first.items()]
    return PhaseCell(
        mean([r.ms for r in says]),
        mean(list(first.values())),
        mean([r.ms for r in setup]),
        mean(incl),
        len(says),
        mean([r.prefilled_tokens for r in says]),
        sum(r.prefilled_tokens for r in setup),
        mean([r.context_tokens for r in says]),
        mean([r.generated_tokens for r in says]),
        sorted({f"{r.kind}:{r.cache_state}" for r in [*setup, *says]}),
    )


@dataclass(slots=True)
class CrossPhase:
    phases: list[str]
    passes: list[dict[str, list[Record]]] = field(default_factory=list)  # by mode

    def cells(self, mode: str, phase: str) -> list[PhaseCell]:
        return [phase_cell(p[mode], phase) for p in self.passes]

    def med(self, mode: str, phase: str, attr: str) -> float | None:
        return median([getattr(c, attr) for c in self.cells(mode, phase)])

    def ratios(self, phase: str, attr: str = "ttft") -> list[float]:
        """Per pass: cold ttft / persistent `attr`."""
        cold, pers = self.cells("cold", phase), self.cells("persistent", phase)
        pairs = zip(cold, pers, strict=True)
        return [r for c, p in pairs if (r := div(c.ttft, getattr(p, attr))) is not None]


def cross_phase(svc: Services, scenario: Scenario, passes: int) -> CrossPhase:
    result = CrossPhase([p.name for p in scenario.phases])
    for i in range(passes):
        records: dict[str, list[Record]] = {}
        for mode in MODES if i % 2 else reversed(MODES):
            started = time.perf_counter()
            namespace = f"{scenario.namespace}-{mode}-p{i}"
            records[mode] = run_pass(svc, scenario, namespace, mode)
            says = [r for r in records[mode] if r.kind == "say"]
            say(
                f"cross-phase pass {i + 1}/{passes} {mode}: {len(says)} turns, "
                f"{time.perf_counter() - started:.1f} s"
            )
        result.passes.append(records)
    return result


# routing


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

    def pass_mean(self, group: str) -> float | None:
        """The median over passes of each pass's mean TTFT."""
        return median([mean([r.ms for r in rs]) for rs in self.records(group)])

    def all_median(self, group: str) -> float | None:
        return median([r.ms for rs in self.records(group) for r in rs])

    def speedups(self, group: str) -> list[float]:
        """Per pass: mean priming TTFT / mean `group` TTFT."""
        out = []
        for cold, other in zip(self.records("priming"), self.records(group), strict=True):
            ratio = div(mean([r.ms for r in cold]), mean([r.ms for r in other]))
            if ratio is not None:
                out.append(ratio)
        return out

    def speedup(self, group: str) -> float | None:
        return div(self.pass_mean("priming"), self.pass_mean(group))


def routing(svc: Services, scenario: Scenario, passes: int) -> Routing:
    result = Routing({r.id for r in scenario.roles if r.document})
    for i in range(passes):
        started = time.perf_counter()
        result.passes.append(run_pass(svc, scenario, f"{scenario.namespace}-p{i}"))
        say(f"routing pass {i + 1}/{passes}: {time.perf_counter() - started:.1f} s")
    return result


def document_tokens(model: Path, scenario: Scenario) -> dict[str, int]:
    tokenizer = load_tokenizer(model)
    return {r.id: len(tokenizer.encode(r.document).ids) for r in scenario.roles if r.document}


def check_fit(model: Path, scenario: Scenario, doc_tokens: dict[str, int], max_context: int) -> str:
    """Refuses documents that cannot fit the model's context; says how they fit."""
    config = json.loads((model / "config.json").read_text())
    limit = min(max_context, config.get("max_position_embeddings", max_context))
    need = max(doc_tokens.values()) + CHAT_OVERHEAD + 8 * scenario.sampling.get("max_tokens", 64)
    if need > limit:
        raise SystemExit(f"expert documents need up to ~{need} tokens; the model allows {limit}")
    return (
        f"expert documents: {min(doc_tokens.values())}-{max(doc_tokens.values())} tokens "
        f"(mean {statistics.fmean(doc_tokens.values()):.0f}); model max_position_embeddings "
        f"{config.get('max_position_embeddings')}, worker max_context {max_context}"
    )


# reporting


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ratio_range(values: Sequence[float]) -> str:
    """Per-pass ratios as min-max, times."""
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "-"


def cross_table(cp: CrossPhase) -> str:
    rows = []
    for n, phase in enumerate(cp.phases):
        cold, pers = cp.med("cold", phase, "ttft"), cp.med("persistent", phase, "ttft")
        incl = cp.med("persistent", phase, "incl_setup")
        paper = [" / ".join(map(str, r[n])) + "x" if n < len(r) else "-" for r in TABLE7.values()]
        rows.append(
            (f"{n + 1}: {phase}", fmt(cold), fmt(pers), times(div(cold, pers)))
            + (fmt(cp.med("persistent", phase, "setup")), fmt(incl), times(div(cold, incl)), *paper)
        )
    headers = ("phase", "cold ttft ms", "persistent ttft ms", "cold/persistent")
    headers += ("persistent create/inject ms", "persistent incl. setup ms", "cold/(incl. setup)")
    headers += ("paper Gemma 3 cold / pers / x", "paper DeepSeek cold / pers / x")
    return table(headers, rows, "l" + "r" * 6 + "ll")


DETAIL = (  # cross_detail_table's medians: (mode, PhaseCell field, digits)
    ("cold", "first_ttft", 1),
    ("persistent", "context", 0),
    ("cold", "prefilled", 0),
    ("persistent", "prefilled", 0),
    ("persistent", "setup_prefilled", 0),
    ("persistent", "generated", 1),
)


def cross_detail_table(cp: CrossPhase) -> str:
    rows = []
    for n, phase in enumerate(cp.phases):
        states = [
            " ".join(sorted({s for c in cp.cells(m, phase) for s in c.states})) for m in MODES
        ]
        rows.append(
            (f"{n + 1}: {phase}", fmt(cp.med("persistent", phase, "turns"), 0))
            + (ratio_range(cp.ratios(phase)), ratio_range(cp.ratios(phase, "incl_setup")))
            + tuple(fmt(cp.med(mode, phase, attr), digits) for mode, attr, digits in DETAIL)
            + tuple(states)
        )
    headers = ("phase", "turns", "cold/persistent per pass", "cold/(incl. setup) per pass")
    headers += ("cold first turns ms", "context tokens", "prefilled/turn cold")
    headers += ("prefilled/turn pers", "pers create/inject prefilled", "generated/turn")
    return table((*headers, "cache states cold", "persistent"), rows, "lrll" + "r" * 6 + "ll")


def routing_table(rt: Routing) -> str:
    paper_key = {"priming": "priming", "queries_warm": "queries", "repeated": "repeated"}
    rows = []
    for key, title, _ in GROUPS:
        every = [r for rs in rt.records(key) for r in rs]
        if not every and key == "other":
            continue
        papers = [str(v[paper_key[key]]) if key in paper_key else "-" for v in TABLE8.values()]
        rows.append(
            (title, fmt(median([len(rs) for rs in rt.records(key)]), 0))
            + (" ".join(sorted({r.cache_state for r in every})) or "-",)
            + (fmt(rt.pass_mean(key)), fmt(rt.all_median(key)))
            + (fmt(mean([r.prefilled_tokens for r in every]), 0),)
            + (fmt(mean([r.context_tokens for r in every]), 0), *papers)
        )
    creates = [r.ms for p in rt.passes for r in p if r.kind == "create" and r.phase == "priming"]
    first = ("(priming: create call, system prompt only)", len(creates) // len(rt.passes), "cold")
    rows.append((*first, fmt(mean(creates)), fmt(median(creates)), "-", "-", "-", "-"))
    headers = ("phase group", "turns/pass", "cache states", "mean ttft ms", "median ttft ms")
    headers += ("prefilled/turn", "context tokens", "paper Gemma 3 ms", "paper DeepSeek ms")
    return table(headers, rows, "lrl" + "r" * 6)


def speedup_table(rt: Routing) -> str:
    rows = [
        (title, times(rt.speedup(group)), ratio_range(rt.speedups(group)))
        + tuple(f"{v[key]}x" if key else "-" for v in TABLE8.values())
        for key, group, title in (
            ("warm", "queries_warm", "warm/cold (priming / first-touch queries)"),
            ("hot", "repeated", "hot/cold (priming / repeated)"),
            ("", "queries_hot", "hot/cold (priming / queries asked again)"),
        )
    ]
    headers = ("speedup", "measured", "per pass", "paper Gemma 3", "paper DeepSeek")
    return table(headers, rows, "lrlrr")


def targets(cp: CrossPhase | None, rt: Routing | None) -> list[dict[str, Any]]:
    goals = []
    if cp is not None and len(cp.phases) >= TARGET_PHASE:
        phase = cp.phases[TARGET_PHASE - 1]
        cold = cp.med("cold", phase, "ttft")
        for attr, what in (("ttft", "persistent"), ("incl_setup", "persistent incl. setup")):
            pers = cp.med("persistent", phase, attr)
            ratio = div(cold, pers) or 0.0
            goals.append(
                {
                    "target": f"phase {TARGET_PHASE} ({phase}) cold/{what} TTFT >= "
                    f"{TARGET_RATIO}x (paper, Gemma 3)",
                    "measured": f"{ratio:.2f}x ({fmt(cold)} vs {fmt(pers)} ms)",
                    "met": ratio >= TARGET_RATIO,
                }
            )
    if rt is not None:
        ratio = rt.speedup("queries_warm") or 0.0
        goals.append(
            {
                "target": f"expert routing warm/cold TTFT speedup >= {TARGET_SPEEDUP:.0f}x "
                "(paper, Gemma 3: 24.2x)",
                "measured": f"{ratio:.1f}x ({fmt(rt.pass_mean('priming'))} vs "
                f"{fmt(rt.pass_mean('queries_warm'))} ms)",
                "met": ratio >= TARGET_SPEEDUP,
            }
        )
    return goals


def notes_for(cp: CrossPhase | None, rt: Routing | None, fit: str, max_tokens: int) -> list[str]:
    notes = [fit]
    if cp is not None:
        last = cp.phases[-1]
        gen = cp.med("persistent", last, "generated")
        notes.append(
            f"cross-phase: persistent context at phase {len(cp.phases)} is "
            f"{fmt(cp.med('persistent', last, 'context'), 0)} tokens per turn on average; "
            f"replies average {fmt(gen)} generated tokens of max_tokens {max_tokens} (greedy "
            "replies end early with EOS, which a turn cannot ignore)"
        )
        if {r.cache_state for p in cp.passes for r in p["cold"]} == {"hot"}:
            notes.append(
                "cross-phase: every cold-mode turn reports cache_state 'hot': the workflow "
                "creates each agent empty (an untimed CreateAgent) just before the re-prefill turn"
            )
    if rt is not None:
        other = [r for rs in rt.records("other") for r in rs]
        if other:
            notes.append(
                f"routing: {len(other)} expert turns found an unexpected cache state: "
                + ", ".join(sorted({f"{r.phase}/{r.agent}:{r.cache_state}" for r in other}))
            )
        if {r.cache_state for rs in rt.records("priming") for r in rs} == {"hot"}:
            notes.append(
                "routing: priming turns report cache_state 'hot' (the agent was just created "
                "with its system prompt); their document is prefilled inside the turn"
            )
    return notes


def draw(cp: CrossPhase | None, rt: Routing | None) -> Any:
    """Per-phase TTFT cold vs persistent, and the routing groups."""

    def panels(axes: Any) -> None:
        left, right = axes
        if cp is not None:
            xs = range(1, len(cp.phases) + 1)
            for mode, attr, style, name in (
                ("cold", "ttft", "o-", "cold (re-prefill)"),
                ("persistent", "ttft", "s-", "persistent"),
                ("persistent", "incl_setup", "s--", "persistent incl. create/inject"),
            ):
                ys = [cp.med(mode, phase, attr) for phase in cp.phases]
                left.plot(xs, [y if y is not None else float("nan") for y in ys], style, label=name)
            left.set_xticks(list(xs), [f"{n}: {p}" for n, p in zip(xs, cp.phases, strict=True)])
            left.set_ylabel("mean TTFT per phase, ms (median of passes)")
            left.set_title("prisoner's dilemma", fontsize=9)
            left.legend(fontsize=7)
        if rt is not None:
            keys = [(k, short) for k, _, short in GROUPS if any(rt.records(k))]
            right.bar(range(len(keys)), [rt.pass_mean(k) or 0.0 for k, _ in keys])
            right.set_xticks(range(len(keys)), [short for _, short in keys], fontsize=7)
            right.set_yscale("log")
            right.set_ylabel("mean TTFT, ms (median of passes, log)")
            right.set_title("expert routing", fontsize=9)

    return panels


EXPLAINED = (
    "TTFT = the worker's usage.time_to_first_token_ms (from the request's arrival); "
    "create/inject = the client's wall time for the call. Cross-phase cells: each pass's "
    "mean over the phase's turns, median over passes; 'incl. setup' = mean over the "
    "phase's speakers of (their create/inject ms in the phase + their first turn's TTFT). "
    "Routing 'mean': each pass's mean, median over passes; 'median': over every turn of "
    "every pass. Client, store and worker share this machine's cores; store writes of "
    "earlier turns run in the background."
)


def sections_for(cp: CrossPhase | None, rt: Routing | None) -> list[tuple[str, str]]:
    sections = []
    if cp is not None:
        title = f"cross-phase, prisoner's dilemma (Table 7 form; median of {len(cp.passes)} passes)"
        sections += [(title, cross_table(cp)), ("cross-phase detail", cross_detail_table(cp))]
    if rt is not None:
        sections += [
            (f"expert routing (Table 8 form; {len(rt.passes)} passes)", routing_table(rt)),
            ("expert routing speedups (means, median of passes)", speedup_table(rt)),
        ]
    return sections


def records_json(records: list[Record]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) | {"text": r.text[:80]} for r in records]


def document(cp: CrossPhase | None, rt: Routing | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cp is not None:
        out["cross_phase"] = {
            "phases": {
                phase: {m: [dataclasses.asdict(c) for c in cp.cells(m, phase)] for m in MODES}
                for phase in cp.phases
            },
            "passes": [{m: records_json(p[m]) for m in MODES} for p in cp.passes],
        }
    if rt is not None:
        out["routing"] = {
            "groups": {
                key: {
                    "mean_ms": rt.pass_mean(key),
                    "median_ms": rt.all_median(key),
                    "pass_means_ms": [mean([r.ms for r in rs]) for rs in rt.records(key)],
                }
                for key, _, _ in GROUPS
            },
            "speedups": {g: rt.speedups(g) for g in ("queries_warm", "queries_hot", "repeated")},
            "passes": [records_json(p) for p in rt.passes],
        }
    return out


def write_report(cp: CrossPhase | None, rt: Routing | None, args: Any, info: Any, fit: str) -> None:
    header = machine(blas=info.blas, model=args.model, model_dir=describe_model(args.path))
    header |= {"device": info.device, "max_context": info.max_context}
    header |= {"kv_format": info.kv_format, "max_tokens": args.max_tokens}
    header |= {"passes": args.passes, "routing_passes": args.routing_passes}
    notes = [*notes_for(cp, rt, fit, args.max_tokens), EXPLAINED]
    goals = targets(cp, rt)
    png = report(
        "workflows", args.out, header, sections_for(cp, rt), goals, notes, document(cp, rt)
    )
    plot(png, header, "workflows", draw(cp, rt), ncols=2, figsize=(13, 4.8))


# main


def parse_args(argv: list[str] | None) -> Any:
    quick = (
        f"1 pass each, no prisoners' warm-up, every reply's max_tokens {QUICK_MAX_TOKENS}, "
        f"documents capped at {QUICK_DOCUMENT_CHARS} chars"
    )
    p = parser(__doc__, passes=5, quick=quick)
    p.add_argument("--routing-passes", type=int, default=3, help="expert routing passes")
    p.add_argument("--max-tokens", type=int, default=64, help="cross-phase replies' max_tokens")
    p.add_argument("--only", choices=("cross-phase", "routing"), help="run one benchmark")
    args = p.parse_args(argv)
    args.document_chars = None
    if args.quick:
        args.passes, args.routing_passes, args.max_tokens = 1, 1, QUICK_MAX_TOKENS
        args.document_chars = QUICK_DOCUMENT_CHARS
    if args.passes < 1 or args.routing_passes < 1 or args.max_tokens < 1:
        p.error("--passes, --routing-passes and --max-tokens must be at least 1")
    return args


def scenarios(args: Any) -> tuple[Scenario, Scenario]:
    """The prisoner's dilemma with --max-tokens replies, and expert routing."""
    prisoners = load_scenario(scenario_path("prisoners_dilemma"))
    sampling = {**prisoners.sampling, "max_tokens": args.max_tokens}
    prisoners = dataclasses.replace(prisoners, sampling=sampling)
    experts = load_scenario(scenario_path("expert_routing"), args.document_chars)
    if args.quick:
        sampling = {**experts.sampling, "max_tokens": QUICK_MAX_TOKENS}
        experts = dataclasses.replace(experts, sampling=sampling)
    return prisoners, experts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prisoners, experts = scenarios(args)
    args.path = model_dir(args.model)  # what the worker loads, too
    say(describe_model(args.path, args.model))
    doc_tokens = document_tokens(args.path, experts)
    root = Path(tempfile.mkdtemp(prefix="agentkv-workflows-"))
    cp = rt = None
    try:
        with services(root, args.path, {"worker": []}) as running:
            info = running.info["worker"]
            svc = Services(running.addresses["worker"], running.store_address, info)
            fit = check_fit(args.path, experts, doc_tokens, info.max_context)
            say(f"store and worker up ({info.blas}, {info.device}); {fit}; warming up")
            warm_up(svc, prisoners, experts, full=not args.quick)
            if args.only in (None, "cross-phase"):
                cp = cross_phase(svc, prisoners, args.passes)
            if args.only in (None, "routing"):
                rt = routing(svc, experts, args.routing_passes)
            if hot_agents(svc):
                say(f"note: {hot_agents(svc)} agents still hot on the worker")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_report(cp, rt, args, info, fit)


if __name__ == "__main__":
    main()
