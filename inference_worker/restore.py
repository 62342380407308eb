"""Warm restore: an agent's stored Q4 blocks back into caches, failing closed.

The manifest says which tokens the agent has and which blocks hold their KV. Any failure to
read those blocks (a missing or corrupt block, an unreachable or refusing store) or a block
that does not fit the model (a tensor of another shape, dtype or token count than its layer
needs) leaves the caches empty: the turn then re-prefills from the manifest's tokens. Wrong
KV is never used.

A restore has two halves: `fetch` reads and checks everything on the caller's thread (an RPC
handler: the store may be slow or hung), `build` turns it into caches on the MLX thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from agentkv.client.blocks import FilesUnreadable, StoredBlock, alloc
from agentkv.client.store import StoreClient
from agentkv.errors import AgentKVError, BlockMisfit, CorruptBlock, CorruptRecord
from inference_worker.agents import Agent
from inference_worker.blocks import (
    HostLayer,
    block_layers,
    caches_from_host,
    check_chain,
    host_layers,
)
from inference_worker.config import WorkerConfig
from inference_worker.conversation import ChatState
from inference_worker.kv_cache import QuantizedKV
from inference_worker.metadata import caller_metadata, chat_state
from inference_worker.runtime import Runtime
from inference_worker.turns import UsageEvent

log = logging.getLogger("agentkv.worker")


@dataclass(slots=True)
class Restored:
    agent: Agent
    tokens_restored: int
    path: str  # "locate", "stream", or "" when nothing was read
    failure: str  # why the blocks could not be used, or ""
    bytes_read: int = 0  # payload bytes read from the store

    def fill(self, usage: UsageEvent) -> None:
        """What the turn that restored the agent reports of it."""
        usage.reused_store_tokens = self.tokens_restored
        usage.cache_state = "warm" if self.tokens_restored else "cold"
        usage.restore_path, usage.restore_failure = self.path, self.failure
        usage.restored_bytes = self.bytes_read


@dataclass(slots=True)
class Fetched:
    """An agent as read from the store, before MLX sees it: its manifest and the usable
    blocks' K and V per layer in host memory, already checked against the model."""

    manifest: Any  # the store's AgentManifest
    read_at: float  # time.monotonic() when the manifest was asked for
    chat: ChatState | None = None  # read from its metadata (a shared prefix's has none)
    layers: list[HostLayer] = field(default_factory=list)  # empty: nothing restored
    keys: list[bytes] = field(default_factory=list)  # the blocks the layers hold
    counts: list[int] = field(default_factory=list)
    path: str = ""
    failure: str = ""
    bytes_read: int = 0


@dataclass(slots=True)
class _Read:
    """How one restore read its blocks: `path`, and whether a local read is `stuck` (in the
    reused buffer, which is then dropped)."""

    path: str
    stuck: bool = False


class Restorer:
    def __init__(self, config: WorkerConfig, runtime: Runtime, store: StoreClient) -> None:
        self.store, self.fingerprint, self.fmt = store, runtime.fingerprint, config.kv
        self.specs = runtime.layers  # every restored tensor must fit them
        self.windows = runtime.windows
        self.block_tokens, self.path = config.block_tokens, runtime.restore_path
        self.chosen = config.restore_path != "auto"  # else: locate, as the store is on loopback
        self.quantized_query_max = runtime.quantized_query_max
        self.vocab_size = runtime.vocab_size
        self._buffer: memoryview | None = None  # reused across restores; fetch copies out
        self._lock = threading.Lock()

    def restore(self, namespace: str, agent_id: str) -> Restored:
        """fetch then build, on one thread (the MLX thread, for build)."""
        return self.build(self.fetch(namespace, agent_id))

    def fetch(self, namespace: str, agent_id: str) -> Fetched:
        """Reads the agent's manifest and blocks; any thread. Raises AgentNotFound /
        FingerprintMismatch / Unavailable from the manifest read; block failures are not
        raised but reported in `failure`."""
        read_at = time.monotonic()
        manifest = self.store.get_agent(namespace, agent_id, fingerprint=self.fingerprint)
        chat = self._readable(manifest)
        missing = set(manifest.missing_block_keys)
        keys, counts = [], []
        for key, n in zip(manifest.block_keys, manifest.block_num_tokens, strict=True):
            if key in missing:
                break
            keys.append(key)
            counts.append(n)
            if n != self.block_tokens:  # a worker's chain ends at its one short block; one
                break  # cut otherwise is read to there, as if it did (the rest prefilled)
        fetched = Fetched(manifest, read_at, chat)
        fetched.failure = f"{len(missing)} block(s) missing in the store" if missing else ""
        if not keys:
            return fetched
        try:
            layers, read = self._read_layers(namespace, keys, counts, manifest.token_ids, fetched)
        except (AgentKVError, OSError, KeyError, ValueError) as exc:
            log.warning(
                "restore failed, re-prefilling", extra={"agent": agent_id, "error": str(exc)}
            )
            kind = CorruptBlock.__name__ if isinstance(exc, CorruptBlock) else type(exc).__name__
            fetched.failure = f"{kind}: {exc}"
            if isinstance(exc, BlockMisfit):
                self._report_misfit(namespace, exc)
            return fetched
        fetched.layers, fetched.keys, fetched.counts = layers, keys, counts
        fetched.bytes_read = read
        return fetched

    def fetch_prefix(self, namespace: str, tokens: list[int]) -> Fetched | None:
        """Blocks of the namespace that hold all of `tokens` (another agent's: a shared
        system prompt), read and checked like a restore's; None when no stored chain holds
        them all, or it cannot be used (the caller prefills instead). Only all: tokens
        prefilled after a stored part would attend over its Q4 KV, where the agent that
        stored it attended over its own in full precision, and the two would not agree bit
        for bit."""
        if len(tokens) < self.block_tokens:
            return None
        try:
            hit = self.store.longest_prefix(namespace, self.fingerprint, tokens)
            keys, counts = list(hit.keys), list(hit.block_num_tokens)
            if hit.num_tokens != len(tokens):
                return None
            layers, read = self._read_layers(namespace, keys, counts, tokens, None)
        except (AgentKVError, OSError, KeyError, ValueError) as exc:
            log.warning("shared prefix unusable, prefilling", extra={"error": str(exc)})
            return None
        return Fetched(None, time.monotonic(), None, layers, keys, counts, self.path, "", read)

    def _readable(self, manifest: Any) -> ChatState:
        """The manifest's conversation state, once its tokens and marks are found to be
        what a worker of this model writes: a token id past the vocabulary would index past
        the embedding table (a crash of the whole worker, or garbage read), and marks that
        are no positions would resume nowhere. Either is CorruptRecord (DATA_LOSS), the
        agent's alone: written by hand, by another client, or damaged."""
        whose = f"agent {manifest.agent_id!r} in namespace {manifest.namespace!r}"
        tokens = manifest.token_ids
        if tokens and (top := max(tokens)) >= self.vocab_size:
            raise CorruptRecord(
                f"{whose}: its stored tokens hold id {top}, past this model's vocabulary of "
                f"{self.vocab_size}: no worker of this model wrote it (delete the agent, or "
                "commit it anew)"
            )
        try:
            chat = chat_state(dict(manifest.metadata))
        except CorruptRecord as exc:
            raise CorruptRecord(f"{whose}: {exc.message}") from None
        # Points past its tokens are no longer there (a store-level fork cut short keeps
        # its source's): a resend cannot resume at them.
        return replace(chat, marks=tuple(m for m in chat.marks if m.end <= len(tokens)))

    def seed(self, agent: Agent, fetched: Fetched) -> int:
        """Gives a new agent's caches the prefix fetch_prefix read (on the MLX thread); the
        store already holds its blocks, so they are not written again. Returns its tokens."""
        agent.caches = caches_from_host(
            fetched.layers, self.windows, self.fmt, self.quantized_query_max, self.block_tokens
        )
        agent.queued_full_keys = leading_full(fetched.keys, fetched.counts, self.block_tokens)
        return sum(fetched.counts)

    def _report_misfit(self, namespace: str, exc: BlockMisfit) -> None:
        """Has the store quarantine a block that cannot be this model's, so the agent's next
        write stores the right KV under its key instead of deduplicating onto it."""
        try:
            for key in exc.keys:
                self.store.report_misfit(namespace, key, exc.message)
        except AgentKVError as error:  # the restore failed either way; the next one retries
            log.warning("could not report a misfit block", extra={"error": error.message})

    def build(self, fetched: Fetched) -> Restored:
        """The agent with caches made from what fetch read; on the MLX thread."""
        m = fetched.manifest
        agent = Agent(
            m.namespace,
            m.agent_id,
            list(m.token_ids),
            self.empty_caches(),
            generation=m.generation,
            phase=m.phase,
            metadata=caller_metadata(m.metadata),
            chat=fetched.chat,
            synced_at=fetched.read_at,
        )
        if not fetched.layers:
            return Restored(agent, 0, fetched.path, fetched.failure)
        agent.caches = caches_from_host(
            fetched.layers, self.windows, self.fmt, self.quantized_query_max, self.block_tokens
        )
        keys, counts = fetched.keys, fetched.counts
        agent.persisted_tokens = sum(counts)
        agent.queued_full_keys = leading_full(keys, counts, self.block_tokens)
        agent.committed_full_keys = list(agent.queued_full_keys)
        return Restored(agent, sum(counts), fetched.path, fetched.failure, fetched.bytes_read)

    def _read_layers(
        self,
        namespace: str,
        keys: list[bytes],
        counts: list[int],
        token_ids: Any,
        fetched: Fetched | None,
    ) -> tuple[list[HostLayer], int]:
        """The blocks' layers in host memory, checked (check_chain, host_layers' specs), and
        the payload bytes read; `fetched.path` says how. The reused buffer is this call's
        alone until it returns (or, a read stuck in it, no one's again)."""
        buffer = self._take_buffer()
        read = _Read(self.path)
        try:
            blocks = self._read(namespace, keys, counts, buffer, read)
            check_chain(blocks, keys, counts, token_ids)
            layers = host_layers(blocks, self.windows, self.fmt, self.block_tokens, self.specs)
            used = sum(t.num_bytes for b in blocks for t in b.tensors)
        finally:
            self._give_back(None if read.stuck else buffer)
            if fetched is not None:
                fetched.path = read.path
        if self.path == "locate" and (buffer is None or used > len(buffer)):
            self._give_back(alloc(2 * used))  # the next restore reads in place
        return layers, used

    def _read(
        self,
        namespace: str,
        keys: list[bytes],
        counts: list[int],
        buffer: memoryview | None,
        read: _Read,
    ) -> list[StoredBlock]:
        """The blocks, each with the layers a restore needs from it (block_layers): one read
        per run of blocks that need the same layers. Files this worker cannot read are
        streamed instead (`read` says so)."""
        plan = block_layers(counts, self.windows, self.block_tokens)
        blocks: list[StoredBlock] = []
        unreadable = None
        for layers, run in itertools.groupby(zip(plan, keys, strict=True), key=lambda x: x[0]):
            run_keys = [k for _, k in run]
            if read.path == "locate":
                try:
                    blocks += self.store.read_blocks_local(
                        namespace,
                        self.fingerprint,
                        run_keys,
                        layers,
                        buffer=buffer if not blocks else None,  # later runs: their own
                    )
                    continue
                except FilesUnreadable as exc:  # this run and the rest stream
                    unreadable, read.path, read.stuck = exc, "stream", exc.stuck
            # a file the store lost too is its DATA_LOSS (quarantined), raised here
            blocks += self.store.get_blocks(namespace, self.fingerprint, run_keys, layers)
        if unreadable is not None:  # the store read what this worker could not
            self._unreadable(unreadable)
        return blocks

    def _unreadable(self, exc: FilesUnreadable) -> None:
        """The store read files this worker cannot: this read streamed them, and, where the
        worker chose to locate only because the store is on loopback, every later one will."""
        if not self.chosen and self.path == "locate":
            self.path = "stream"
            log.warning(
                "the store's files cannot be read here: restores stream from now on "
                "(--restore-path stream says so up front)",
                extra={"error": str(exc)},
            )
        else:
            log.warning("a located file cannot be read here: streamed", extra={"error": str(exc)})

    def _take_buffer(self) -> memoryview | None:
        with self._lock:
            buffer, self._buffer = self._buffer, None
        return buffer

    def _give_back(self, buffer: memoryview | None) -> None:
        """Keeps the larger of the held buffer and `buffer` for the next restore."""
        with self._lock:
            if buffer is not None and (self._buffer is None or len(buffer) > len(self._buffer)):
                self._buffer = buffer

    def empty_caches(self) -> list[QuantizedKV]:
        """One empty cache per layer, windowed where the layer is (a new agent's caches)."""
        return [
            QuantizedKV(self.fmt, self.quantized_query_max, w, self.block_tokens)
            for w in self.windows
        ]


def leading_full(keys: list[bytes], counts: list[int], block_tokens: int) -> list[bytes]:
    """The chain's leading full blocks, from its first to the first short one: the next
    write cuts its blocks on from their end."""
    pairs = itertools.takewhile(lambda kn: kn[1] == block_tokens, zip(keys, counts, strict=True))
    return [key for key, _ in pairs]
