"""A guided tour of the cache store: the README's main command until the worker lands.

Starts `agentkv-store` as its own process on a temporary directory, then stores, dedups,
restores (both paths), forks, races, corrupts and heals Llama-3.1-8B-shaped Q4 KV blocks.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from agentkv import defaults
from agentkv.client.store import StoreClient
from agentkv.client.synthetic import make_chain
from agentkv.client.worker import WorkerClient
from agentkv.errors import CorruptBlock, GenerationConflict
from agentkv.launch import ServiceProcess, running, store_process, worker_process
from agentkv.units import human_bytes, table
from agentkv.v1 import store_pb2 as pb

NS = "walkthrough"
FP = "llama-3.1-8b-shaped:q4g64:walkthrough"
LLAMA_8B = {"num_layers": 32, "kv_heads": 8, "head_dim": 128}
BLOCK = 256
SYSTEM = list(range(1, 513))  # a 512-token system prompt every agent shares
TOY_MODEL = Path(__file__).resolve().parent.parent / "models" / "agentkv-default"
MARCO = "You are Marco, a Python expert. " + "You answer from the standard library. " * 60


def step(title: str) -> None:
    print(f"\n== {title}")


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def store_agent(c: StoreClient, agent_id: str, tokens: list[int], seed: int):
    blocks, keys = make_chain(tokens, FP, BLOCK, seed=seed, **LLAMA_8B)
    (put, _), seconds = timed(c.save_agent, NS, agent_id, FP, tokens, blocks, phase="interrogation")
    size = human_bytes(sum(r.num_bytes for r in put.blocks))
    dedup = sum(r.deduplicated for r in put.blocks)
    print(
        f"{agent_id}: {len(tokens)} tokens, {len(keys)} blocks, {size}, "
        f"{dedup} already stored (deduplicated); saved in {seconds * 1000:.0f} ms"
    )
    return blocks, keys


def restore(c: StoreClient, keys: list[bytes], blocks) -> None:
    streamed, t_stream = timed(lambda: list(c.get_blocks(NS, FP, keys)))
    located, t_locate = timed(c.read_blocks_local, NS, FP, keys)
    mib = sum(t.num_bytes for b in streamed for t in b.tensors) / 2**20
    exact = all(
        bytes(a.data) == bytes(s.data) == bytes(l_.data)
        for block, s_block, l_block in zip(blocks, streamed, located, strict=True)
        for a, s, l_ in zip(block.tensors, s_block.tensors, l_block.tensors, strict=True)
    )
    print(f"gRPC stream:           {t_stream * 1000:6.0f} ms  ({mib / t_stream:,.0f} MiB/s)")
    print(f"locate + direct read:  {t_locate * 1000:6.0f} ms  ({mib / t_locate:,.0f} MiB/s)")
    print(
        "  (one cold pass on this machine as it is now; python benchmarks/store_io.py "
        "measures both paths with repeats, as the README's tables do)"
    )
    print(f"bit-exact on both paths: {exact}")


def corrupt_and_heal(c: StoreClient, data_dir: Path, agent_id: str, blocks, keys) -> None:
    victim = keys[-1]
    path = data_dir / "blocks" / NS / victim.hex()[:2] / f"{victim.hex()}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(raw)
    print(f"flipped one byte in {path.name[:16]}...")
    try:
        list(c.get_blocks(NS, FP, [victim]))
    except CorruptBlock as exc:
        print(f"read -> {exc.code.name}: {exc.message}")
    agent = c.get_agent(NS, agent_id)
    print(
        f"{agent_id}'s manifest survives; missing blocks: "
        f"{[k.hex()[:16] for k in agent.missing_block_keys]}"
    )
    print(
        f"quarantine now holds: {[p.name[:16] for p in (data_dir / 'quarantine' / NS).iterdir()]}"
    )
    put = c.put_blocks(NS, FP, blocks[-1:])
    c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
    healed = c.get_agent(NS, agent_id)
    print(
        f"re-put the block (a worker would re-prefill it): missing now "
        f"{len(healed.missing_block_keys)}"
    )


def race(c: StoreClient, agent_id: str) -> None:
    current = c.get_agent(NS, agent_id)
    fields = dict(
        namespace=NS,
        agent_id=agent_id,
        fingerprint=FP,
        token_ids=current.token_ids,
        block_keys=current.block_keys,
        expected_generation=current.generation,
    )
    first = c.commit_agent(**fields, phase="the-yard")
    print(f"worker 1 commits at generation {current.generation} -> now {first.generation}")
    try:
        c.commit_agent(**fields, phase="final-reckoning")
    except GenerationConflict as exc:
        print(
            f"worker 2 commits at generation {current.generation} -> {exc.code.name}: {exc.message}"
        )


def tour(c: StoreClient, data_dir: Path) -> None:
    from agentkv.client.inspect import cmd_agents, cmd_blocks, cmd_stats

    step("1. Store agents' Q4 KV blocks (Llama-3.1-8B shape: 32 layers, 8 KV heads, dim 128)")
    warden = store_agent(c, "warden", SYSTEM + list(range(1000, 1512)), seed=0)
    prisoner = store_agent(c, "prisoner-a", SYSTEM + list(range(2000, 2256)), seed=0)
    step("2. Restore the warden's attention state, both ways")
    restore(c, *reversed(warden))
    step("3. A new conversation asks for its longest cached prefix")
    hit = c.longest_prefix(NS, FP, SYSTEM + [7, 7, 7])
    print(f"{hit.num_tokens} of {len(SYSTEM) + 3} tokens are cached in {len(hit.keys)} blocks")
    step("4. Fork an analyst from the warden's first 512 tokens (shares blocks, copies nothing)")
    fork = c.fork_agent(NS, "warden", "analyst", num_tokens=512)
    print(f"analyst: {len(fork.token_ids)} tokens over {len(fork.block_keys)} shared blocks")
    cmd_blocks(c, type("A", (), {"namespace": NS}))
    step("5. Two workers race to commit the same agent")
    race(c, "warden")
    step("6. Corruption is caught, quarantined, and healed")
    corrupt_and_heal(c, data_dir, "prisoner-a", *prisoner)
    step("7. What the store holds")
    cmd_agents(c, type("A", (), {"namespace": NS}))
    print()
    cmd_stats(c, None)


def worker_tour(store_address: str, root: Path, services: dict[str, ServiceProcess]) -> None:
    """The worker over the store: cold, hot, warm after eviction, warm after a restart. The
    worker is in `services` from before it starts, for the caller to stop."""
    # The repository's small trained model is quick; an install without it (a wheel) takes
    # the shipped default.
    model = str(TOY_MODEL) if TOY_MODEL.exists() else defaults.MODEL
    step(f"8. agentkv-worker serves a model ({Path(model).name}) over the store")
    log = root / "worker.log"
    worker = services["worker"] = worker_process(model, store_address, log, own_session=True)
    worker.start()
    with WorkerClient(worker.address) as w:  # closed before the restart: no channel left
        info = w.info()
        print(f"worker pid {worker.proc.pid}: {info.fingerprint}, BLAS {Path(info.blas).name}")
        t = time.perf_counter()
        w.create_agent("demo", "marco", MARCO)
        print(
            f"marco: {w.describe('demo', 'marco').num_tokens}-token system prompt prefilled "
            f"(cold) in {(time.perf_counter() - t) * 1000:.0f} ms"
        )
        rows = [ask(w, "What does join in posixpath do?"), ask(w, "What does sorted do?")]
        w.evict("demo", "marco")
        rows.append(ask(w, "What does open do?"))
    worker.stop()
    worker = services["worker"] = worker_process(model, store_address, log, own_session=True)
    worker.start()
    with WorkerClient(worker.address) as w:
        rows.append(ask(w, "What does print do?"))
    print(table(["turn", "cache", "ttft ms", "reused", "prefilled", "reply"], rows))


def ask(w: WorkerClient, question: str) -> list[object]:
    r = w.turn("demo", "marco", [("user", question)], max_tokens=24)
    u = r.usage
    reused = u.reused_hot_tokens + u.reused_store_tokens
    return [
        question,
        u.cache_state,
        f"{u.time_to_first_token_ms:.1f}",
        reused,
        u.prefilled_tokens,
        r.text.strip()[:40],
    ]


def run(keep: bool = False) -> None:
    root = Path(tempfile.mkdtemp(prefix="agentkv-walkthrough-"))
    services = {"store": store_process(root / "data", root / "store.log", own_session=True)}
    # from here, whatever ends the tour (a Ctrl-C, a store that never starts) cleans up
    with running(services, root, keep):
        service = services["store"].start()
        pid, address = service.proc.pid, service.address
        print(f"agentkv-store running as pid {pid} on {address}, data in {root}")
        with StoreClient(service.address) as client:
            tour(client, root / "data")
        worker_tour(service.address, root, services)
