"""The SDK's workflows and routing, through real store and worker processes on tiny models.

Both shipped scenarios run end to end with the cache-state sequence asserted; routing keeps
an agent on its worker, and when that worker is killed the agent's next turn succeeds on
another one, warm, with the tokens it would have had. Bad scenarios and messages get clear
errors. Who-hears-whom is checked without a model, on a recording fake.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from agentkv.client.demo import scenario_path
from agentkv.client.memory import AgentMemory
from agentkv.client.scenario import ScenarioError, load_scenario, parse_scenario, run_scenario
from agentkv.client.workflow import Role, Workflow
from agentkv.errors import AgentNotFound, InvalidArgument, Unavailable
from tests.helpers import cli

SCENARIOS = Path(__file__).resolve().parent.parent / "client" / "scenarios"


# who hears whom, on a fake memory


class FakeAgent:
    def __init__(self, log: list, agent_id: str) -> None:
        self.log, self.id, self.created, self.state = log, agent_id, True, None

    def say(self, messages, **options):
        self.log.append(("say", self.id, list(messages)))
        return FakeReply(f"{self.id} speaks")

    def inject(self, message, **options):
        self.log.append(("inject", self.id, message))

        class Result:
            class usage:
                cache_state, prefilled_tokens = "hot", 1

            class agent:
                num_tokens = 1

        return Result

    def delete(self):
        self.log.append(("delete", self.id, None))

    def evict(self):
        self.log.append(("evict", self.id, None))


class FakeReply:
    worker = "fake"

    def __init__(self, text: str) -> None:
        self.text = text

        class usage:
            cache_state, time_to_first_token_ms = "hot", 1.0
            prefilled_tokens = prompt_tokens = generated_tokens = 1

        self.usage = usage


class FakeMemory:
    workers: dict = {}  # none to ask what context they hold (scenario.check_fits)

    def __init__(self) -> None:
        self.log: list = []

    def agent(self, agent_id, system=None, phase=""):
        self.log.append(("create", agent_id, system))
        return FakeAgent(self.log, agent_id)


def test_permanent_agents_are_injected_with_what_they_heard_and_nothing_else():
    mem = FakeMemory()
    flow = Workflow(
        mem,
        [
            Role("warden", "W"),
            Role("a", "A", hears=("warden",)),
            Role("b", "B", hears=("warden",)),
            Role("analyst", "X", permanent=False),
        ],
    )
    with flow.phase("one", brief="Day one.") as p:
        p.say("warden", "Speak.")
        p.say("a", "Answer.")
        p.say("b", "Answer.")
    mem.log.clear()
    with flow.phase("two") as p:
        p.say("analyst", "Explain.")
    injected = {agent: text for kind, agent, text in mem.log if kind == "inject"}
    assert set(injected) == {"warden"}  # a and b heard nothing new: nobody injected them
    assert "a speaks" in injected["warden"] and "b speaks" in injected["warden"]
    creates = [agent for kind, agent, _ in mem.log if kind == "create"]
    assert creates == ["analyst"]
    (_, _, messages), *_ = [e for e in mem.log if e[0] == "say"]
    heard = messages[-1][1]
    assert "Day one." in heard and "warden speaks" in heard and "a speaks" in heard
    assert ("delete", "analyst", None) in mem.log  # ephemeral: gone when its phase ends
    first_b = [e for e in flow.records if e.agent == "b" and e.kind == "say"]
    assert first_b and flow.transcript[3].speaker == "b"  # after the brief, warden and a


def test_news_a_failed_turn_carried_goes_with_the_next():
    mem = FakeMemory()
    flow = Workflow(mem, [Role("warden", "W"), Role("a", "A", hears=("warden",))])
    with flow.phase("one") as p:
        p.say("a", "Answer.")
    agent = flow.member("a").agent
    works = agent.say

    def down_once(messages, **options):
        agent.say = works
        raise Unavailable("worker went away")

    with flow.phase("two") as p:
        p.say("warden", "Speak.")
        agent.say = down_once
        with pytest.raises(Unavailable):
            p.say("a", "Answer.")
        p.say("a", "Answer again.")
    (_, _, messages) = [e for e in mem.log if e[0] == "say" and e[1] == "a"][-1]
    assert messages[-1][1] == 'Warden said: "warden speaks"\n\nAnswer again.'


def test_a_phase_whose_cleanup_fails_is_left_and_its_own_error_stands():
    mem = FakeMemory()
    flow = Workflow(mem, [Role("warden", "W"), Role("clerk", "C", permanent=False)])

    def gone():
        raise Unavailable("worker went away")

    with pytest.raises(ValueError, match="the phase's own"), flow.phase("one") as p:
        p.say("clerk", "Note it.")
        flow.member("clerk").agent.delete = gone
        raise ValueError("the phase's own error")
    assert flow.current is None and flow.member("clerk").agent is None
    # Nothing else failed: the cleanup's error is raised.
    with pytest.raises(Unavailable, match="went away"), flow.phase("two") as p:
        p.say("clerk", "Note it.")
        flow.member("clerk").agent.delete = gone
    assert flow.current is None
    with flow.phase("three") as p:
        p.say("warden", "Speak.")


def test_an_ephemeral_agent_left_over_is_made_anew():
    mem = FakeMemory()
    make = mem.agent

    def existing(agent_id, system=None, phase=""):
        agent = make(agent_id, system, phase)
        agent.created = sum(e[:2] == ("create", agent_id) for e in mem.log) > 1
        return agent

    mem.agent = existing
    flow = Workflow(mem, [Role("warden", "W", permanent=False)])
    with flow.phase("one") as p:
        p.say("warden", "Speak.")
    kinds = [e[0] for e in mem.log]
    assert kinds == ["create", "delete", "create", "say", "delete"]


def test_the_prisoners_never_hear_each_other():
    mem = FakeMemory()
    scenario = load_scenario(SCENARIOS / "prisoners_dilemma.yaml")
    run_scenario(scenario, mem, reset=False)
    for kind, agent, payload in mem.log:
        text = str(payload)
        if agent == "alice" and kind in ("say", "inject"):
            assert "bob:" not in text
        if agent == "bob" and kind in ("say", "inject"):
            assert "alice:" not in text


def test_a_phase_whose_start_fails_is_left_as_if_it_never_began():
    mem = FakeMemory()
    flow = Workflow(
        mem, [Role("warden", "W"), Role("a", "A"), Role("b", "B"), Role("e", "E", permanent=False)]
    )
    with flow.phase("one", brief="Day one.") as p:
        for role in ("warden", "a", "b"):
            p.say(role, "Speak.")
    agent = flow.member("a").agent
    works = agent.inject

    def down(message, **options):
        raise Unavailable("no worker could be reached")

    agent.inject = down
    with pytest.raises(Unavailable), flow.phase("two", brief="Day two."):
        pass
    assert flow.current is None
    with pytest.raises(InvalidArgument, match="inside a phase"):
        flow.say("e", "Note it.")  # no say inside the phase that never began
    # The warden's injection went through and carried the brief; the others get none of it
    # (the ephemeral e still has phase one's, for its first turn).
    agent.inject = works
    mem.log.clear()
    with flow.phase("three", brief="Day three.") as p:
        p.say("warden", "Speak.")
        p.say("e", "Note it.")
    injected = {agent: text for kind, agent, text in mem.log if kind == "inject"}
    # in the order they came: b's reply in phase one, then phase three's brief
    assert injected["a"] == 'B said: "b speaks"\n\nDay three.'  # no "Day two."
    assert "b" in injected  # after the failing member: briefed too
    (_, _, messages), *_ = [e for e in mem.log if e[:2] == ("say", "e")]
    assert messages[-1][1].startswith("Day one.") and "Day two." not in messages[-1][1]


@pytest.mark.parametrize("mode", ["persistent", "cold"])
def test_a_failed_first_turn_is_retried_with_what_a_first_turn_carries(mode):
    mem = FakeMemory()
    flow = Workflow(
        mem, [Role("w", "You are W."), Role("x", "You are X.", document="<DOC>")], mode=mode
    )
    make = mem.agent

    def failing_once(agent_id, system=None, phase=""):
        agent = make(agent_id, system, phase)
        if agent_id == "x":
            works = agent.say

            def down(messages, **options):
                mem.log.append(("failed", agent_id, list(messages)))
                agent.say = works
                raise Unavailable("worker went away")

            agent.say = down
        return agent

    mem.agent = failing_once
    # Cold mode makes x anew in phase two, with its history.
    for name in ("one", "two") if mode == "cold" else ("one",):
        mem.log.clear()
        with flow.phase(name) as p:
            p.say("w", "Speak.")
            with pytest.raises(Unavailable):
                p.say("x", "Answer.")
            p.say("x", "Answer.")
        (failed,) = [e[2] for e in mem.log if e[0] == "failed"]
        (retried,) = [e[2] for e in mem.log if e[:2] == ("say", "x")]
        assert retried == failed
        assert "<DOC>" in str(retried)
        if mode == "cold" and name == "two":
            assert retried[0] == ("system", "You are X.") and len(retried) > 2
    says = [r for r in flow.records if r.kind == "say" and r.agent == "x"]
    assert says[0].cache_state == "cold"  # its first turn, though a retry


def test_agents_speaking_at_once_from_threads_hear_each_other():
    mem = FakeMemory()
    flow = Workflow(mem, [Role("x", "X"), Role("y", "Y"), Role("z", "Z")])
    with flow.phase("one") as p:
        p.say("x", "hi")
        p.say("y", "hi")
    x_started, y_done = threading.Event(), threading.Event()
    agent = flow.member("x").agent
    works = agent.say

    def slow(messages, **options):  # x's turn, its news read, ends after y's
        x_started.set()
        assert y_done.wait(60)
        return works(messages, **options)

    agent.say = slow
    with flow.phase("two") as p:
        x_turn = threading.Thread(target=p.say, args=("x", "go"))
        x_turn.start()
        assert x_started.wait(60)  # y speaks after x's turn began, while it runs
        p.say("y", "go")
        y_done.set()
        x_turn.join(60)
    assert [s.speaker for s in flow.transcript[2:]] == ["y", "x"]
    mem.log.clear()
    with flow.phase("three"):
        pass
    injected = {agent: text for kind, agent, text in mem.log if kind == "inject"}
    assert injected["x"] == 'Y said: "y speaks"'  # y's phase-two reply, not x's own


def test_a_failed_delete_leaves_no_other_ephemeral_agent_behind():
    mem = FakeMemory()
    roles = [Role("w", "W"), Role("e1", "E1", permanent=False), Role("e2", "E2", permanent=False)]
    flow = Workflow(mem, roles)

    def gone():
        raise Unavailable("worker went away")

    with pytest.raises(Unavailable, match="went away"), flow.phase("one", evict_after=True) as p:
        p.say("w", "Speak.")
        p.say("e1", "Note it.")
        p.say("e2", "Note it.")
        flow.member("e1").agent.delete = gone
    assert flow.member("e1").agent is None and flow.member("e2").agent is None
    assert ("delete", "e2", None) in mem.log and ("evict", "w", None) in mem.log
    mem.log.clear()
    with flow.phase("two") as p:
        p.say("e2", "Note it again.")
    assert [e[0] for e in mem.log if e[1] == "e2"] == ["create", "say", "delete"]


# real processes


def test_a_rerun_workflow_labels_an_existing_agents_turn_as_the_worker_found_it(
    tiny_model_dirs, start_worker, store_process
):
    worker = start_worker(tiny_model_dirs["llama"])
    with AgentMemory(worker.address, store_process.address, "rerun") as mem:
        for run in range(2):
            flow = Workflow(
                mem, [Role("warden", "You are the warden.")], sampling={"max_tokens": 4}
            )
            with flow.phase("one") as p:
                p.say("warden", f"Speak, run {run}.")
            (said,) = [r for r in flow.records if r.kind == "say"]
            if run == 0:
                assert said.cache_state == "cold"  # created for this turn
            else:  # the agent of the first run, still hot on its worker: most tokens reused
                assert said.cache_state == "hot"
                assert said.prefilled_tokens < said.context_tokens


def test_prisoners_dilemma_end_to_end(tiny_model_dirs, start_worker, store_process):
    scenario = load_scenario(scenario_path("prisoners_dilemma"))
    worker = start_worker(tiny_model_dirs["llama"])
    with AgentMemory(worker.address, store_process.address, scenario.namespace) as mem:
        flow = run_scenario(scenario, mem)
        by_phase: dict[str, list] = {}
        for r in flow.records:
            by_phase.setdefault(r.phase, []).append(r)
        assert list(by_phase) == [p.name for p in scenario.phases]
        first = by_phase["arrest"]
        assert [(r.kind, r.cache_state) for r in first if r.kind == "create"] == [
            ("create", "cold")
        ] * 3
        for phase in list(by_phase)[1:]:  # permanent agents are warm or hot after phase 1
            for r in by_phase[phase]:
                if r.agent != "analyst":
                    assert r.cache_state in ("hot", "warm"), (phase, r)
        assert [r.kind for r in by_phase["verdict"] if r.agent == "analyst"] == ["create", "say"]
        with pytest.raises(AgentNotFound):
            mem.agent("analyst").describe()  # ephemeral: deleted when its phase ended
        tiers = {a.agent_id: a.tier for a in mem.agents()}
        assert tiers == {"warden": "hot", "alice": "hot", "bob": "hot"}
        says = [r for r in flow.records if r.kind == "say"]
        assert all(r.generated_tokens > 0 for r in says)
        # Persistent agents never re-prefill their past: each turn prefills little.
        later = [r for r in says if r.phase != "arrest" and r.agent != "analyst"]
        assert all(r.prefilled_tokens < r.context_tokens / 3 for r in later)


def test_expert_routing_end_to_end(tiny_model_dirs, start_worker, store_process):
    scenario = load_scenario(scenario_path("expert_routing"), document_chars=1200)
    worker = start_worker(tiny_model_dirs["llama"])
    with AgentMemory(worker.address, store_process.address, scenario.namespace) as mem:
        flow = run_scenario(scenario, mem)
    says = {
        p.name: [r for r in flow.records if r.phase == p.name and r.kind == "say"]
        for p in scenario.phases
    }
    assert len(says["priming"]) == 10 and len(says["repeated"]) == 3
    assert all(r.prefilled_tokens > 250 for r in says["priming"])  # the document went in
    first_query = {}
    for r in says["queries"]:
        first_query.setdefault(r.agent, r.cache_state)
    experts = {k: v for k, v in first_query.items() if k != "reporter"}
    assert set(experts.values()) == {"warm"}  # evicted after priming, restored from the store
    assert all(r.cache_state == "hot" for r in says["repeated"])


def test_routing_affinity_and_failover_lose_nothing(tiny_model_dirs, start_worker, store_process):
    model = tiny_model_dirs["llama"]
    workers = [start_worker(model, name=f"w{i}") for i in range(2)]
    by_address = {w.address: w for w in workers}
    mem = AgentMemory([w.address for w in workers], store_process.address, "route", durable=True)
    # Rendezvous spreads agents over both workers: all 64 on one has p = 2^-63 (8 had 1/128,
    # and ports differ from run to run). The turns go to 4 agents homed on each.
    homes = {f"agent-{i}": mem.worker_for(f"agent-{i}") for i in range(64)}
    assert set(homes.values()) == set(by_address)
    ids = [agent_id for w in by_address for agent_id in [a for a in homes if homes[a] == w][:4]]
    agents = {agent_id: mem.agent(agent_id, "You are a helpful agent.") for agent_id in ids}
    for agent_id, agent in agents.items():
        first = agent.say("Hello there.", max_tokens=4).wait()
        second = agent.say("And again.", max_tokens=4).wait()
        assert first.worker == second.worker == homes[agent_id]
        assert second.cache_state == "hot"

    # A reference agent on a worker that never dies, with the same history.
    victim_id = ids[0]
    victim = by_address[homes[victim_id]]
    survivor = next(w for w in workers if w is not victim)
    ref = AgentMemory(survivor.address, store_process.address, "route-ref")
    ref_agent = ref.agent(victim_id, "You are a helpful agent.")
    ref_agent.say("Hello there.", max_tokens=4).wait()
    ref_agent.say("And again.", max_tokens=4).wait()

    victim.kill9()
    reply = agents[victim_id].say("Where were we?", max_tokens=12)
    assert reply.worker == survivor.address
    assert reply.cache_state == "warm"  # restored from the store: nothing lost
    assert reply.token_ids == ref_agent.say("Where were we?", max_tokens=12).token_ids
    state = agents[victim_id].describe()
    assert state.tier == "hot" and state.num_tokens == ref_agent.describe().num_tokens
    mem.close()
    ref.close()


def test_bad_scenarios_and_messages_get_clear_errors(tmp_path, tiny_model_dirs, start_worker):
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents: [\n  - id: a\n phases: {")
    with pytest.raises(ScenarioError, match=r"bad.yaml: line \d+, column \d+: not valid YAML"):
        load_scenario(bad)
    base = {"agents": [{"id": "a", "system": "S"}], "phases": [{"name": "p", "turns": []}]}
    cases = [
        (
            {**base, "phases": [{"name": "p", "turns": [{"agent": "ghost", "say": "hi"}]}]},
            r"phases\[0\].turns\[0\].agent: unknown agent 'ghost'",
        ),
        (
            {**base, "phases": [{"name": "p", "turns": [{"agent": "a", "say": " "}]}]},
            r"phases\[0\].turns\[0\].say: must not be empty",
        ),
        (
            {**base, "phases": [{"name": "p", "turns": [{"agent": "a"}]}]},
            r"phases\[0\].turns\[0\]: missing key 'say'",
        ),
        ({**base, "agents": [{"id": "a", "hears": ["zed"]}]}, r"agents\[0\].hears: unknown agent"),
        ({**base, "agents": [{"id": "a"}, {"id": "a"}]}, "defined twice"),
        ({**base, "agents": [{"id": "a", "colour": "red"}]}, "unknown key 'colour'"),
        ({**base, "agents": [{"id": "bad id"}]}, r"agents\[0\].id: 'bad id' is not a valid id"),
        (
            {**base, "agents": [{"id": "a", "document": {"module": "no.such.module"}}]},
            "is not a pure-Python standard-library module",
        ),
        ({"agents": [{"id": "a"}]}, "missing key 'phases'"),
        ([1, 2], "must be a mapping"),
        ({**base, "sampling": {"max_tokens": "lots"}}, r"sampling.max_tokens: must be a whole"),
        ({**base, "sampling": {"temperature": "hot"}}, "sampling.temperature: must be a number"),
        ({**base, "sampling": {"seed": 1.5}}, "sampling.seed: must be a whole number"),
        ({**base, "sampling": {"top_p": 2}}, r"sampling.top_p: must be a number in \[0, 1\]"),
        ({**base, "sampling": {"stop": [""]}}, "sampling.stop: must be text or a list"),
        (
            {
                **base,
                "phases": [{"name": "p", "turns": [{"agent": "a", "say": "x", "max_tokens": 1.0}]}],
            },
            r"phases\[0\].turns\[0\].max_tokens: must be a whole number",
        ),
    ]
    for data, message in cases:
        with pytest.raises(ScenarioError, match=message):
            parse_scenario(data, "case.yaml")
    turn = {"name": "p", "turns": [{"agent": "a", "say": "hi"}]}
    one_stop = parse_scenario({**base, "phases": [turn], "sampling": {"stop": "END"}})
    assert one_stop.sampling["stop"] == ["END"]  # one stop string, not "E", "N" and "D"

    worker = start_worker(tiny_model_dirs["llama"])
    with AgentMemory(worker.address, namespace="bad") as mem:
        agent = mem.agent("a", "You are terse.")
        with pytest.raises(InvalidArgument, match="empty"):
            agent.say("")
        flow = Workflow(mem, [Role("a", "You are terse.")])
        with pytest.raises(InvalidArgument, match="inside a phase"):
            flow.say("a", "hello")
        with flow.phase("p") as p:
            with pytest.raises(InvalidArgument, match="not in the workflow"):
                p.say("ghost", "hello")
            with pytest.raises(InvalidArgument, match="empty"):
                p.say("a", "  ")
        with pytest.raises(InvalidArgument, match="listing agents needs the store"):
            mem.agents()
        assert agent.describe().num_tokens > 0  # still intact


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sampling": {"temperature": 50}}, r"sampling.temperature: must be a number in \[0, 10\]"),
        ({"sampling": {"temperature": math.inf}}, "sampling.temperature: must be a number"),
        (
            {"phases": [{"name": "p" * 257, "turns": [{"agent": "a", "say": "hi"}]}]},
            r"phases\[0\].name: is 257 characters, limit 256",
        ),
        ({"sampling": {"stop": ["x" * 257]}}, "sampling.stop: a stop string has 256 characters"),
        (
            {"sampling": {"stop": list("abcdefghijklmnopq")}},
            "sampling.stop: 17 stop strings, limit 16",
        ),
        ({"name": "my scenario"}, r"name: 'my scenario' is no valid namespace .*give a namespace"),
    ],
    ids=["temperature-50", "temperature-inf", "long-phase", "long-stop", "17-stops", "name-ns"],
)
def test_what_the_worker_would_refuse_fails_at_load_naming_the_file(tmp_path, change, message):
    """Before a run's reset deletes its agents, not at its first turn."""
    data = {
        "agents": [{"id": "a"}],
        "phases": [{"name": "p", "turns": [{"agent": "a", "say": "hi"}]}],
    }
    path = tmp_path / "hot.yaml"
    path.write_text(yaml.safe_dump({**data, **change}))
    with pytest.raises(ScenarioError, match=f"{re.escape(str(path))}: {message}"):
        load_scenario(path)


def test_a_scenario_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(
        ScenarioError, match=f"{re.escape(str(path))}: not UTF-8 text \\(a bad byte at offset 9\\)"
    ):
        load_scenario(path)


def test_a_scenario_within_the_limits_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "name: my scenario\nnamespace: mine\nsampling: {stop: [a, b, c, d, e, f, g, h, i, j, "
        "k, l, m, n, o, p]}\nbase: &base {id: a, system: A}\n"
    )
    with pytest.raises(ScenarioError, match="unknown key 'base'"):
        load_scenario(path)  # anchors live inside the known keys
    path.write_text(
        "name: my scenario\nnamespace: mine\nsampling: {stop: [a, b, c, d, e, f, g, h, i, j, "
        "k, l, m, n, o, p]}\nagents:\n  - &a {id: a, system: A}\n  - {<<: *a, id: b}\n"
        "phases: [{name: p, turns: [{agent: b, say: hi}]}]\n"
    )
    scenario = load_scenario(path)
    assert scenario.namespace == "mine" and len(scenario.sampling["stop"]) == 16
    assert [r.id for r in scenario.roles] == ["a", "b"]  # a merge key overridden is no repeat


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "name: s\nagents: [{id: a}]\nphases: [{name: p, turns: [{agent: a, say: hi}]}]\n"
            "phases: [{name: q, turns: [{agent: a, say: bye}]}]\n",
            "line 4, column 1: not valid YAML: the key 'phases' appears twice",
        ),
        (
            "agents: [{id: a, system: A, id: b}]\nphases: []\n",
            "line 1, column 29: not valid YAML: the key 'id' appears twice",
        ),
    ],
    ids=["top", "nested"],
)
def test_a_key_given_twice_is_refused_naming_it(tmp_path, text, message):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=f"{re.escape(str(path))}: {message}"):
        load_scenario(path)


def test_a_scenario_over_the_size_limit_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ScenarioError, match=f"{re.escape(str(path))}: over 1 MiB"):
        load_scenario(path)
    if Path("/dev/zero").exists():  # endless: refused after 1 MiB, not read until memory ends
        with pytest.raises(ScenarioError, match="/dev/zero: over 1 MiB"):
            load_scenario("/dev/zero")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: !!set [1]\n", "line 1, column 7: not valid YAML: expected a mapping node"),
        ("name: !!bool maybe\n", r"not valid YAML: a value its tag cannot hold \('maybe'\)"),
        ("name: !!timestamp foo\n", "not valid YAML: a value its tag cannot hold"),
        ("name: !!float abc\n", "not valid YAML: a value its tag cannot hold .*float: 'abc'"),
        ("x: " + "1" * 5000 + "\n", r"not valid YAML: a value its tag cannot hold \(Exceeds"),
        ("x: !!timestamp 2024-13-45\n", r"a value its tag cannot hold \(month must be in"),
    ],
    ids=["set-scalar", "bool", "timestamp", "float", "long-int", "bad-date"],
)
def test_a_value_its_tag_cannot_hold_is_not_valid_yaml_naming_the_file(tmp_path, text, message):
    """The reviewer's: yaml's constructors raise bare TypeError, KeyError, ValueError and
    AttributeError on these; the CLI printed a traceback or a line naming no file."""
    path = tmp_path / "tagged.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=f"{re.escape(str(path))}: .*{message}"):
        load_scenario(path)


def test_documents_are_read_once_and_capped_in_all(tmp_path, monkeypatch):
    """The reviewer's: a 1 MiB file naming a 757 KB module for 15,000 agents read it anew for
    each, 23 GB. Each module is read once, and the documents together are capped."""
    reads = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, **kw: reads.append(p) or read_text(p, **kw))
    turn = [{"name": "p", "turns": [{"agent": "a0", "say": "hi"}]}]
    document = {"module": "pydoc_data.topics", "chars": 600_000}  # 757 KB in 3.11
    data = {"agents": [{"id": f"a{i}", "document": document} for i in range(4)], "phases": turn}
    with pytest.raises(ScenarioError, match=r"agents\[\d\].document: the documents pass 1,048"):
        parse_scenario(data, "case.yaml")
    assert len(reads) == 1  # refused at the second agent, the module read once
    ten = [{"id": f"a{i}", "document": {"module": "json"}} for i in range(10)]
    reads.clear()
    parse_scenario({"agents": ten, "phases": turn}, "case.yaml")
    assert len(reads) == 1  # json/__init__.py, for ten agents


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"module": "x" * 300}, "module: 'x.* is not a pure-Python standard-library module"),
        ({"text": "abc", "chars": -5}, "chars: goes with a module, not a text"),
    ],
    ids=["long-module", "chars-with-text"],
)
def test_a_document_the_file_gets_wrong_names_its_place(document, message):
    data = {
        "agents": [{"id": "a", "document": document}],
        "phases": [{"name": "p", "turns": [{"agent": "a", "say": "hi"}]}],
    }
    with pytest.raises(ScenarioError, match=rf"case.yaml: agents\[0\]\.document\.{message}"):
        parse_scenario(data, "case.yaml")


def test_a_namespace_given_runs_a_file_whose_name_is_none(tmp_path):
    """The reviewer's: `agentkv run My.Scenario.yaml -n mine` refused the file's name as a
    namespace before it looked at -n."""
    path = tmp_path / "My.Scenario.yaml"
    path.write_text("agents: [{id: a}]\nphases: [{name: p, turns: [{agent: a, say: hi}]}]\n")
    with pytest.raises(ScenarioError, match="no valid namespace"):
        load_scenario(path)
    assert load_scenario(path, namespace="mine").namespace == "mine"


def test_a_document_module_that_is_not_utf8_names_it(tmp_path, monkeypatch):
    source = tmp_path / "koi8.py"
    source.write_bytes("# -*- coding: koi8-r -*-\nx = '\u0436'\n".encode("koi8-r"))
    monkeypatch.setattr("agentkv.client.scenario._stdlib_source", lambda module: source)
    data = {
        "agents": [{"id": "a", "document": {"module": "test.test_source_encoding"}}],
        "phases": [{"name": "p", "turns": [{"agent": "a", "say": "hi"}]}],
    }
    with pytest.raises(
        ScenarioError,
        match=r"case.yaml: agents\[0\].document.module: 'test.test_source_encoding' \(.*koi8.py\) "
        "is not UTF-8 text",
    ):
        parse_scenario(data, "case.yaml")


def test_cli_runs_a_scenario_and_lists_agents(
    tmp_path, tiny_model_dirs, start_worker, store_process
):
    worker = start_worker(tiny_model_dirs["llama"])
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nagents:\n  - {id: a, system: You are A.}\n  - {id: b, system: You are B.}\n"
        "phases:\n  - name: one\n    turns:\n      - {agent: a, say: Hello.}\n"
        "      - {agent: b, say: Answer A.}\n  - name: two\n    turns:\n"
        "      - {agent: a, say: Go on.}\n"
    )
    flags = ["--store", store_process.address, "--worker", worker.address]
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "run", str(scenario), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "phase two" in run.stdout and "inject a" in run.stdout.replace("  ", " ")
    listed = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "agents", "-n", "tiny", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[2:]]
    assert sorted(r[0] for r in rows) == ["a", "b"] and {r[1] for r in rows} == {"hot"}
    bad = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "run", str(tmp_path / "missing.yaml"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "cannot read" in bad.stderr
    typo = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "run", "prisoners_dilema", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert typo.returncode == 2, typo.stderr
    assert "nor a shipped scenario (expert_routing, prisoners_dilemma)" in typo.stderr
    # A max_tokens past the model's context (4,096) is refused before the reset, in a line.
    scenario.write_text(
        scenario.read_text().replace("say: Go on.}", "say: Go on., max_tokens: 5000}")
    )
    long = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "run", str(scenario), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert long.returncode == 2 and "Traceback" not in long.stderr
    assert "phase 'two', turn 1 (a) asks for up to 5000 tokens" in long.stderr
    assert "holds 4096 tokens of context" in long.stderr
    again = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "agents", "-n", "tiny", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sorted(line.split()[0] for line in again.stdout.splitlines()[2:]) == ["a", "b"]


@pytest.mark.timeout(1200)  # over pytest's 300 s default: the demo runs SmolLM2
def test_the_demo_runs_end_to_end():
    """The README's main command, on the default model (SmolLM2): every agent resumes warm."""
    run = cli("demo", timeout=1100)  # about 4 minutes on SmolLM2 on 2 cores
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for phase in ("arrest", "interrogation", "deal", "pressure", "verdict", "epilogue"):
        assert f"phase {phase}" in out
    assert "resumed warm from the store: alice, bob, warden" in out
    summary = out.split("per phase", 1)[1]
    assert re.search(r"^verdict +4 ", summary, re.M)
    ratios = [float(x) for x in re.findall(r"([\d.]+)x\s*$", summary, re.M)]
    assert len(ratios) == 5 and all(r > 0 for r in ratios)  # timings vary: no speed claims


def test_news_comes_in_the_order_it_happened_and_an_ephemeral_role_hears_every_brief():
    """The reviewer's: a phase's brief came ahead of the replies said before it, and an
    ephemeral role made anew missed the briefs its earlier self had."""
    mem = FakeMemory()
    flow = Workflow(mem, [Role("w", "W"), Role("e", "E", permanent=False)])
    for n in (1, 2, 3):
        with flow.phase(f"p{n}", brief=f"BRIEF-{n}") as p:
            p.say("w", "Speak.")
            if n != 2:
                p.say("e", "Note it.")
    injected = [text for kind, agent, text in mem.log if kind == "inject"]
    assert injected[0] == 'E said: "e speaks"\n\nBRIEF-2'  # p1's reply, then p2's brief
    says = [messages[-1][1] for kind, agent, messages in mem.log if (kind, agent) == ("say", "e")]
    w = 'W said: "w speaks"'  # its own reply in p1 is not news to it
    assert says[-1] == "\n\n".join(["BRIEF-1", w, "BRIEF-2", w, "BRIEF-3", w, "Note it."])


def test_an_agent_that_already_existed_is_not_sent_its_document_again():
    """The reviewer's: `agentkv run --no-reset` sent each agent's document with its first
    turn of every run, so its context grew by the document each time."""
    mem = FakeMemory()
    make = mem.agent

    def existing(agent_id, system=None, phase=""):
        agent = make(agent_id, system, phase)
        agent.created = False  # a rerun finds it in the store
        return agent

    mem.agent = existing
    flow = Workflow(mem, [Role("x", "X", document="<DOC>")])
    with flow.phase("one") as p:
        p.say("x", "Go.")
    (_, _, messages), *_ = [e for e in mem.log if e[0] == "say"]
    assert messages == [("user", "Go.")]
