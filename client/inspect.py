"""`agentkv store ...`: a store's counters, namespaces, agents and blocks as tables, and its
maintenance calls; each command prints to stdout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from agentkv.client.store import StoreClient
from agentkv.errors import AgentKVError
from agentkv.units import human_bytes, human_seconds, table, utc_time
from agentkv.v1 import store_pb2 as pb


def quota_text(num_bytes: int) -> str:
    return human_bytes(num_bytes) if num_bytes else "none"


def cmd_stats(client: StoreClient, args: argparse.Namespace) -> None:
    s = client.stats()
    print(
        table(
            ["field", "value"],
            [
                ("namespaces", s.num_namespaces),
                ("agents", s.num_agents),
                ("blocks", s.num_blocks),
                ("stored", human_bytes(s.num_bytes)),
                ("quota", quota_text(s.quota_bytes)),
                ("evicted blocks", s.num_evicted_blocks),
                ("evicted agents", s.num_evicted_agents),
                ("expired agents", s.num_expired_agents),
                ("quarantined", s.num_quarantined),
                ("leases", s.num_leases),
                ("disk free", human_bytes(s.disk_free_bytes)),
                *_object_store_rows(s),
            ],
        )
    )


def _object_store_rows(s: pb.GetStatsResponse) -> list[tuple[str, object]]:
    if not s.object_store:
        return [("object store", "none")]
    return [
        ("object store", s.object_store),
        ("object store state", s.object_store_state),
        ("upload queue", s.object_queue_depth),
        ("demoted blocks", s.num_demoted_blocks),
        ("rehydrated blocks", s.num_rehydrated_blocks),
        ("written to it", human_bytes(s.object_put_bytes)),
        ("read from it", human_bytes(s.object_get_bytes)),
    ]


def cmd_namespaces(client: StoreClient, args: argparse.Namespace) -> None:
    reply = client.call("ListNamespaces", pb.ListNamespacesRequest())
    rows = [
        (
            n.name,
            n.num_agents,
            n.num_blocks,
            human_bytes(n.num_bytes),
            human_bytes(n.num_record_bytes),
            quota_text(n.quota_bytes),
            human_seconds(n.agent_idle_seconds) if n.agent_idle_seconds else "none",
        )
        for n in reply.namespaces
    ]
    print(table(["namespace", "agents", "blocks", "bytes", "records", "quota", "retention"], rows))


def cmd_agents(client: StoreClient, args: argparse.Namespace) -> None:
    rows = [
        (
            a.agent_id,
            a.num_tokens,
            a.num_blocks,
            human_bytes(a.num_bytes),
            a.phase or "-",
            a.generation,
            utc_time(a.updated_unix_ms),
        )
        for a in client.list_agents(args.namespace)
    ]
    print(table(["agent", "tokens", "blocks", "bytes", "phase", "gen", "updated (UTC)"], rows))
    print_elsewhere(client, args.namespace, rows)


def print_elsewhere(store: StoreClient, namespace: str, rows: list) -> None:
    """For a listing of no agents: the namespaces that hold some, and how to name one."""
    if rows:
        return
    try:
        reply = store.call("ListNamespaces", pb.ListNamespacesRequest())
    except AgentKVError:  # a token for one namespace may not list them all: no hint then
        return
    found = ", ".join(f"{n.name} ({n.num_agents})" for n in reply.namespaces if n.num_agents)
    if found:
        print(f"no agents in namespace {namespace!r}; agents are in: {found} (pass -n NAME)")


def cmd_agent(client: StoreClient, args: argparse.Namespace) -> None:
    a = client.get_agent(args.namespace, args.agent_id, peek=True)
    missing, remote = set(a.missing_block_keys), set(a.remote_block_keys)
    print(
        table(
            ["field", "value"],
            [
                ("agent", a.agent_id),
                ("namespace", a.namespace),
                ("fingerprint", a.fingerprint),
                ("tokens", len(a.token_ids)),
                ("blocks", len(a.block_keys)),
                ("bytes", human_bytes(a.num_bytes)),
                ("phase", a.phase or "-"),
                ("generation", a.generation),
                ("created (UTC)", utc_time(a.created_unix_ms)),
                ("updated (UTC)", utc_time(a.updated_unix_ms)),
                *((f"metadata.{k}", v) for k, v in sorted(a.metadata.items())),
            ],
        )
    )
    print()
    state = {**dict.fromkeys(remote, "in the object store"), **dict.fromkeys(missing, "MISSING")}
    rows = [
        (i, k.hex()[:16], n, state.get(k, "ok"))
        for i, (k, n) in enumerate(zip(a.block_keys, a.block_num_tokens, strict=True))
    ]
    print(table(["#", "block", "tokens", "state"], rows))


def cmd_blocks(client: StoreClient, args: argparse.Namespace) -> None:
    rows = [
        (
            b.key.hex()[:16],
            b.parent_key.hex()[:16] or "(root)",
            b.num_tokens,
            human_bytes(b.num_bytes),
            b.refcount,
            utc_time(b.last_access_unix_ms),
        )
        for b in client.list_blocks(args.namespace)
    ]
    print(table(["block", "parent", "tokens", "bytes", "refs", "last access (UTC)"], rows))


def cmd_verify(client: StoreClient, args: argparse.Namespace) -> None:
    reply = client.call(
        "VerifyBlocks", pb.VerifyBlocksRequest(namespace=args.namespace or ""), timeout=3600
    )
    remote = (
        f"; {reply.num_remote} only in the object store, not read here (checked when fetched)"
        if reply.num_remote
        else ""
    )
    print(
        f"checked {reply.num_checked} blocks, {human_bytes(reply.num_bytes)}; "
        f"{len(reply.corrupt)} corrupt (quarantined){remote}"
    )
    for c in reply.corrupt:
        print(f"  {c.namespace}/{c.key.hex()}: {c.reason}")
    if reply.corrupt_records:
        print(f"{len(reply.corrupt_records)} corrupt index records (quarantined)")
    for r in reply.corrupt_records:
        print(f"  {r.table} {r.namespace}/{r.id}: {r.reason}")
    if reply.corrupt or reply.corrupt_records:
        sys.exit(1)


def cmd_gc(client: StoreClient, args: argparse.Namespace) -> None:
    reply = client.call("CollectGarbage", pb.CollectGarbageRequest(namespace=args.namespace or ""))
    print(
        f"deleted {reply.num_blocks_deleted} unreferenced blocks "
        f"({human_bytes(reply.num_bytes_freed)}), removed {reply.num_orphans_removed} orphan files"
    )


def cmd_delete(client: StoreClient, args: argparse.Namespace) -> None:
    released = client.delete_agent(args.namespace, args.agent_id)
    refs = "1 block reference" if released == 1 else f"{released} block references"
    print(f"deleted {args.namespace}/{args.agent_id}; released {refs}")


STORE_COMMANDS: dict[str, tuple[Callable[[StoreClient, argparse.Namespace], None], str]] = {
    "stats": (cmd_stats, "store-wide counters and capacity"),
    "namespaces": (cmd_namespaces, "namespaces with their usage"),
    "agents": (cmd_agents, "agents of a namespace"),
    "agent": (cmd_agent, "one agent's manifest and blocks"),
    "blocks": (cmd_blocks, "blocks of a namespace"),
    "verify": (cmd_verify, "re-read every payload and index record and check every checksum"),
    "gc": (cmd_gc, "delete unreferenced blocks and orphan files"),
    "delete": (cmd_delete, "delete one agent (a worker holding it finds it gone)"),
}
