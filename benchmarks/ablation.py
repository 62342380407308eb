"""Ablation, the paper's Table 6: what each component buys, with against without.

Runs no model: each row is read from the JSON another section wrote (the newest under
--results); the README says which measurement each row takes.
Run: python benchmarks/ablation.py [--results benchmarks/results] [--out DIR]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness as h
from paper import TABLE6, TABLE14_BUDGET_BYTES

from agentkv import planner

CONTEXT = {"persistence": 4096, "capacity": 8192, "batching": 1024, "windows": 8192}  # paper's
BATCH = 4
Three = tuple[float, float, float]  # min, median, max


def three(values: Any) -> Three:
    """(min, median, max) of samples, of one value, or of a {min, median, max} summary."""
    if isinstance(values, dict):
        return values["min"], values["median"], values["max"]
    values = values if isinstance(values, list) else [values]
    return min(values), statistics.median(values), max(values)


def nearest(items: list[dict], key: str, row: str) -> dict:
    """The item whose `key` is the row's context, else the largest below, else the smallest."""
    below = [i for i in items if i[key] <= CONTEXT[row]]
    return max(below, key=lambda i: i[key]) if below else min(items, key=lambda i: i[key])


# each row from its section's JSON: (metric, with, without)


def persistence(doc: dict) -> tuple[str, Three, Three]:
    model = next(m for m in doc["models"] if m["contexts"])
    c = nearest(model["contexts"], "nominal_tokens", "persistence")
    at, s = h.label(c["nominal_tokens"]), c["summary_ms"]
    metric = f"TTFT ms at {at}: warm (locate) restore vs cold prefill ({model['name']})"
    return metric, three(s["warm (locate)"]), three(s["cold"])


def capacity(doc: dict) -> tuple[str, Three, Three]:
    """Q4 hot bytes measured (the full-length worker) against the planner's FP16, in the
    paper's 10.2 GiB scaled so that FP16 fits as many agents as Gemma 3 12B's at 8K."""
    c = nearest(doc["capacity"], "context", "capacity")
    gemma = planner.plan(planner.load_config("gemma3_12b"), CONTEXT["capacity"], 1)
    budget = TABLE14_BUDGET_BYTES * c["plan_fp16_bytes"] // gemma.fp16_bytes
    at = f"{h.label(c['context'])} in {budget / 2**20:.1f} MiB"
    metric = f"agents at {at}, Gemma-3-shaped: Q4 (measured hot bytes) vs FP16 (planner)"
    q4, fp16 = budget // c["measured_full_bytes"], budget // c["plan_fp16_bytes"]
    return metric, three(q4), three(fp16)


def batching(doc: dict) -> tuple[str, Three, Three]:
    c = nearest([c for c in doc["cells"] if c["batch"] == BATCH], "context", "batching")
    metric = f"SysTPS, {BATCH} hot agents at {h.label(c['context'])}: at once vs one by one"
    return metric, three(c["sys_tps"]["batched"]), three(c["sys_tps"]["sequential"])


def cross_phase(doc: dict) -> tuple[str, Three, Three]:
    phases = doc["cross_phase"]["phases"]
    name, modes = list(phases.items())[-1]
    ttft = {m: three([c["ttft"] for c in cells]) for m, cells in modes.items()}
    metric = f"TTFT ms, phase {len(phases)} ({name}) mean: persistent vs cold"
    return metric, ttft["persistent"], ttft["cold"]


def windows(doc: dict) -> tuple[str, Three, Three]:
    c = nearest(doc["contexts"], "nominal_tokens", "windows")
    hot = {m: three(c["modes"][m]["summary"]["hot_bytes"]) for m in c["modes"]}
    mb = {m: tuple(v / 1e6 for v in values) for m, values in hot.items()}
    metric = f"hot MB per agent at {h.label(c['nominal_tokens'])}, Gemma-3-shaped: window vs full"
    return metric, mb["window"], mb["full"]


@dataclass(frozen=True, slots=True)
class Spec:
    component: str
    stem: str  # the JSON it reads: benchmarks/<stem>.py's
    build: Callable[[dict], tuple[str, Three, Three]]
    names: tuple[str, str]  # the chart's bars
    lower_is_better: bool = False  # TTFT and bytes: effect = without / with
    digits: int = 1


WINDOW_BARS = ("window-aware", "full-length")
SPECS = {
    "persistence": Spec("Persistence", "ttft", persistence, ("warm", "cold"), True),
    "capacity": Spec("Q4 vs FP16", "windows", capacity, ("Q4", "FP16 (planner)"), digits=0),
    "batching": Spec("Batching", "batching", batching, (f"batch {BATCH}", "one by one")),
    "cross-phase": Spec("Cross-phase", "workflows", cross_phase, ("persistent", "cold"), True),
    "windows": Spec("Window-aware (not in the paper)", "windows", windows, WINDOW_BARS, True, 2),
}


@dataclass(slots=True)
class Row:
    key: str
    metric: str
    with_: Three
    without: Three
    source: str  # the JSON it came from

    @property
    def spec(self) -> Spec:
        return SPECS[self.key]

    @property
    def effect(self) -> float:
        w, wo = self.with_[1], self.without[1]
        return wo / w if self.spec.lower_is_better else w / wo

    def cell(self, values: Three) -> str:
        return f"{values[1]:.{self.spec.digits}f}"


def derive(results: Path) -> tuple[list[Row], list[str]]:
    """Every row whose source section left its JSON under `results`; notes for the rest."""
    rows, notes = [], []
    for key, spec in SPECS.items():
        found = sorted(results.rglob(f"{spec.stem}-*.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            notes.append(
                f"{key}: no {spec.stem}-*.json under {results} (run benchmarks/{spec.stem}.py)"
            )
            continue
        try:
            rows.append(Row(key, *spec.build(json.loads(found[-1].read_text())), str(found[-1])))
        except (KeyError, StopIteration, ValueError, TypeError) as exc:
            notes.append(f"{key}: {found[-1]} does not hold the measurement ({exc!r})")
    return rows, notes + [f"{r.key}: from {r.source}" for r in rows]


def summary_table(rows: list[Row]) -> str:
    cells = []
    for r in rows:
        p = TABLE6.get(r.key)
        paper = (f"{p.with_:g}", f"{p.without:g}{p.star}", f"{p.effect:.1f}x{p.star}") if p else ()
        ours = (r.cell(r.with_), r.cell(r.without), f"{r.effect:.1f}x")
        cells.append((r.spec.component, r.metric, *ours, *(paper or ("-",) * 3)))
    headers = ("component", "metric", "with", "without", "effect", "paper with")
    return h.table((*headers, "paper without", "paper effect"), cells, "ll" + "r" * 6)


def draw(rows: list[Row], axes: Any) -> None:
    """With and without per component (min..max whiskers), effects beside the paper's."""
    for ax, r in zip(axes, rows, strict=True):
        both, p = (r.with_, r.without), TABLE6.get(r.key)
        mids = [v[1] for v in both]
        err = [[v[1] - v[0] for v in both], [v[2] - v[1] for v in both]]
        ax.bar(list(r.spec.names), mids, yerr=err, capsize=4, color=["tab:green", "tab:gray"])
        ref = f"; paper {p.effect:.1f}x{p.star}" if p else ""
        ax.set_title(f"{r.spec.component}\n{r.effect:.1f}x{ref}", fontsize=8)
        ax.set_ylabel(r.metric.split(":")[0], fontsize=7)
        if r.spec.lower_is_better and max(mids) / max(min(mids), 1e-9) > 20:
            ax.set_yscale("log")


def main(argv: list[str] | None = None) -> None:
    quick = "the same (it reads what the --quick sections wrote)"
    p = h.parser(__doc__, model=False, quick_help=quick)
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    rows, notes = derive(args.results)
    header = h.machine(results=str(args.results))
    sections = [("component contributions (Table 6 form; medians)", summary_table(rows))]
    goals = [
        h.goal(
            f"{r.spec.component}: effect >= the paper's {TABLE6[r.key].effect:.1f}x",
            f"{r.effect:.2f}x ({r.cell(r.with_)} with, {r.cell(r.without)} without)",
            r.effect >= TABLE6[r.key].effect,
        )
        for r in rows
        if r.key in TABLE6
    ]
    document = {"paper_table6": {k: asdict(v) for k, v in TABLE6.items()}}
    document["rows"] = [asdict(r) | {"effect": r.effect} for r in rows]
    png = h.report("ablation", args.out, header, sections, goals, notes, document)
    if rows:
        size = (3.2 * len(rows), 4.2)
        h.plot(png, header, "ablation", draw, rows, ncols=len(rows), figsize=size)


if __name__ == "__main__":
    main()
