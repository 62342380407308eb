"""Warm restore: an agent's stored Q4 blocks back into caches, failing closed.

The manifest says which tokens the agent has and which blocks hold their KV. Any failure to
read those blocks (a missing or corrupt block, an unreachable or refusing store) leaves the
caches empty: the turn then re-prefills from the manifest's tokens. Wrong KV is never used.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from agentkv.errors import AgentKVError
from client.blocks import StoredBlock, alloc
from client.store import StoreClient
from inference_worker.agents import Agent
from inference_worker.blocks import block_layers, caches_from_blocks
from inference_worker.kv_cache import QuantizedKV
from inference_worker.kv_format import KVFormat
from inference_worker.persistence import caller_metadata, chat_state

log = logging.getLogger("agentkv.worker")


@dataclass(slots=True)
class Restored:
    agent: Agent
    tokens_restored: int
    path: str  # "locate", "stream", or "" when nothing was read
    failure: str  # why the blocks could not be used, or ""
    bytes_read: int = 0  # payload bytes read from the store


@dataclass(slots=True)
class Restorer:
    client: StoreClient
    fingerprint: str
    fmt: KVFormat
    num_layers: int
    block_tokens: int
    path: str  # "locate" or "stream"
    quantized_query_max: int = 1
    windows: list[int | None] | None = None  # per layer; None: every layer full-length
    _buffer: memoryview | None = None  # reused across restores; the caches copy out of it

    def restore(self, namespace: str, agent_id: str) -> Restored:
        """Raises AgentNotFound / FingerprintMismatch / Unavailable from the manifest read;
        block failures are not raised but reported in `failure`."""
        manifest = self.client.get_agent(namespace, agent_id, fingerprint=self.fingerprint)
        missing = set(manifest.missing_block_keys)
        keys, counts = [], []
        for key, n in zip(manifest.block_keys, manifest.block_num_tokens, strict=True):
            if key in missing:
                break
            keys.append(key)
            counts.append(n)
        agent = Agent(
            namespace,
            agent_id,
            list(manifest.token_ids),
            self.empty_caches(),
            generation=manifest.generation,
            phase=manifest.phase,
            metadata=caller_metadata(manifest.metadata),
            chat=chat_state(manifest.metadata),
        )
        failure = f"{len(missing)} block(s) missing in the store" if missing else ""
        if not keys:
            return Restored(agent, 0, "", failure)
        try:
            blocks = self._read(namespace, keys, counts)
            agent.caches = caches_from_blocks(
                blocks,
                self.num_layers,
                self.fmt,
                self.quantized_query_max,
                self.windows,
                self.block_tokens,
            )
        except (AgentKVError, OSError, KeyError, ValueError) as exc:
            log.warning(
                "restore failed, re-prefilling", extra={"agent": agent_id, "error": str(exc)}
            )
            return Restored(agent, 0, self.path, f"{type(exc).__name__}: {exc}")
        covered = sum(counts)
        agent.persisted_tokens = covered
        agent.queued_full_keys = [
            k for k, n in zip(keys, counts, strict=True) if n == self.block_tokens
        ]
        if len(agent.queued_full_keys) < len(keys) - 1:  # a short block mid-chain: recut
            agent.queued_full_keys = []
        agent.committed_full_keys = list(agent.queued_full_keys)
        read = sum(t.num_bytes for b in blocks for t in b.tensors)
        return Restored(agent, covered, self.path, failure, read)

    def _read(self, namespace: str, keys: list[bytes], counts: list[int]) -> list[StoredBlock]:
        """The blocks, each with the layers a restore needs from it (block_layers): one read
        per run of blocks that need the same layers."""
        windows = self.windows or [None] * self.num_layers
        plan = block_layers(counts, windows, self.block_tokens)
        blocks: list[StoredBlock] = []
        for layers, run in itertools.groupby(zip(plan, keys, strict=True), key=lambda x: x[0]):
            run_keys = [k for _, k in run]
            if self.path == "stream":
                blocks += self.client.get_blocks(namespace, self.fingerprint, run_keys, layers)
                continue
            buffer = self._buffer if len(blocks) == 0 else None  # later runs: their own
            blocks += self.client.read_blocks_local(
                namespace, self.fingerprint, run_keys, layers, buffer=buffer
            )
        if self.path == "locate":
            used = sum(t.num_bytes for b in blocks for t in b.tensors)
            if self._buffer is None or used > len(self._buffer):
                self._buffer = alloc(2 * used)  # the next restore reads in place
        return blocks

    def empty_caches(self) -> list[QuantizedKV]:
        """One empty cache per layer, windowed where the layer is (a new agent's caches)."""
        windows = self.windows or [None] * self.num_layers
        return [
            QuantizedKV(self.fmt, self.quantized_query_max, w, self.block_tokens) for w in windows
        ]
