"""protos/ is the contract, from another language: a Node.js client (tests/node/contract.mjs),
its stubs built from the .proto files at run time by the official @grpc/grpc-js and
@grpc/proto-loader, against real store and worker processes; each answer it prints is
compared with the Python SDK's.

Skipped only where `node` is not installed. Where it is, missing packages fail the test: a
silent skip would hide a broken contract (scripts/setup.sh runs `npm ci` in tests/node).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentKVError
from agentkv.keys import block_key
from agentkv.launch import store_process, worker_process
from tests.helpers import FP, make_chain

NODE_DIR = Path(__file__).parent / "node"
SYSTEM = "You are the archivist of the lighthouse. " * 6
QUESTION = "Which ships passed the rocks last winter?"
SCHEMA = {  # bounded: a random model's reply ends within MAX_TOKENS
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
MAX_TOKENS = 12
AGENT = "twin"  # the same agent in two namespaces: one made from Node, one from Python
NODE_NS, PYTHON_NS, BLOCK_NS = "node", "python", "blocks"
UNKNOWN = "nobody-here"
NODE_SPANS = [[101, 102, 103], [104, 105]]  # the chain Node uploads
TIMING = ("time_to_first_token_ms", "decode_tokens_per_second")


@pytest.fixture(scope="module")
def node_path() -> str:
    """The node binary, checked first: nothing starts for a test that cannot run."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH: this contract test from Node.js needs Node.js >= 18")
    wanted = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]
    missing = [name for name in wanted if not (NODE_DIR / "node_modules" / name).is_dir()]
    if missing:
        pytest.fail(
            f"node is installed but tests/node lacks {', '.join(missing)}: run "
            "`bash scripts/setup.sh` (or `npm ci` in tests/node)",
            pytrace=False,
        )
    return node


@pytest.fixture(scope="module")
def store_address(node_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("other-language-store")
    proc = store_process(root / "data", root / "store.log").start()
    yield proc.address
    proc.stop()


@pytest.fixture(scope="module")
def worker_address(store_address, tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("other-language-worker")
    model = str(tiny_model_dirs["gemma3_text"])  # its greedy replies vary, unlike llama's
    extra = ["--block-tokens", "64"]
    proc = worker_process(model, store_address, root / "worker.log", extra_args=extra).start()
    yield proc.address
    proc.stop()


@pytest.fixture(scope="module")
def python_blocks(store_address):
    """A chain of two blocks that Python puts and Node reads."""
    blocks, keys = make_chain([11, 12, 13, 14], block_tokens=2, num_layers=1, kv_heads=1)
    with StoreClient(store_address) as store:
        store.put_blocks(BLOCK_NS, FP, blocks)
    return blocks, keys


@pytest.fixture(scope="module")
def node(node_path, store_address, worker_address, python_blocks) -> dict:
    """What contract.mjs printed, run once against this module's servers."""
    config = {
        "store": store_address,
        "worker": worker_address,
        "namespace": NODE_NS,
        "agent_id": AGENT,
        "system": SYSTEM,
        "question": QUESTION,
        "max_tokens": MAX_TOKENS,
        "unknown_agent": UNKNOWN,
        "fingerprint": FP,
        "block_namespace": BLOCK_NS,
        "put_spans": NODE_SPANS,
        "read_keys": [key.hex() for key in python_blocks[1]],
        "form": {"namespace": f"{NODE_NS}-form", "schema": SCHEMA, "max_tokens": 48},
    }
    done = subprocess.run(
        [node_path, "contract.mjs", json.dumps(config)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"contract.mjs failed:\n{done.stderr}"
    return json.loads(done.stdout)


def as_dict(message) -> dict:
    """A message as proto-loader gives it from Node (snake_case, defaults, 64-bit as text)."""
    return MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def drop(fields: dict, names: tuple[str, ...]) -> dict:
    return {k: v for k, v in fields.items() if k not in names}


def test_a_reply_held_to_a_schema_from_node_is_the_python_sdks(node, worker_address):
    """OutputFormat (a oneof) from Node: the same JSON the Python SDK gets, of the schema."""
    namespace = f"{PYTHON_NS}-form"  # its own: no prefix shared with the other test's agents
    with WorkerClient(worker_address) as worker:
        worker.create_agent(namespace, AGENT, system=SYSTEM)
        reply = worker.turn(
            namespace, AGENT, [("user", QUESTION)], max_tokens=48, temperature=0.0,
            output_format=SCHEMA,
        )  # fmt: skip
    assert json.loads(reply.text)["answer"] in SCHEMA["properties"]["answer"]["enum"]
    assert node["formed"]["text"] == reply.text and node["formed"]["usage"]["finish_reason"] == (
        "stop"
    )


def test_a_greedy_turn_from_node_is_the_python_sdks(node, worker_address):
    with WorkerClient(worker_address) as worker:
        created = worker.create_agent(PYTHON_NS, AGENT, system=SYSTEM)
        reply = worker.turn(
            PYTHON_NS, AGENT, [("user", QUESTION)], max_tokens=MAX_TOKENS, temperature=0.0,
            durable=True,
        )  # fmt: skip
        described = worker.describe(PYTHON_NS, AGENT)
    assert len(set(reply.token_ids)) > 2  # a reply, not one token repeated
    assert node["turn"]["token_ids"] == reply.token_ids
    assert node["turn"]["text"] == reply.text
    assert drop(node["turn"]["usage"], TIMING) == drop(as_dict(reply.usage), TIMING)
    # A new agent's first commit runs in the background: its reply may come before or after.
    racy = ("generation", "persisted_tokens")
    assert drop(node["created"], racy) == drop({**as_dict(created), "namespace": NODE_NS}, racy)
    assert node["described"] == {**as_dict(described), "namespace": NODE_NS}
    assert node["described"]["tier"] == "hot" and int(node["described"]["num_bytes"]) > 0


def raised(call: Callable[[], object]) -> dict:
    """What the Python SDK raised, in the terms contract.mjs prints a failure."""
    with pytest.raises(AgentKVError) as info:
        call()
    error = info.value
    return {"code": error.code.name, "details": error.message, "error": type(error).__name__}


def test_errors_reach_node_as_the_python_sdk_raises_them(node, store_address, worker_address):
    ask = [("user", QUESTION)]
    with WorkerClient(worker_address) as worker, StoreClient(store_address) as store:
        python = {
            "describe_unknown": raised(lambda: worker.describe(NODE_NS, UNKNOWN)),
            "turn_unknown": raised(lambda: worker.turn(NODE_NS, UNKNOWN, ask, max_tokens=4)),
            "store_get_unknown": raised(lambda: store.get_agent(NODE_NS, UNKNOWN)),
            "create_empty_id": raised(lambda: worker.create_agent(NODE_NS, "")),
            "get_no_keys": raised(lambda: list(store.get_blocks(BLOCK_NS, FP, []))),
        }
    assert node["failures"] == python
    assert {name: (f["code"], f["error"]) for name, f in node["failures"].items()} == {
        "describe_unknown": ("NOT_FOUND", "AgentNotFound"),
        "turn_unknown": ("NOT_FOUND", "AgentNotFound"),
        "store_get_unknown": ("NOT_FOUND", "AgentNotFound"),
        "create_empty_id": ("INVALID_ARGUMENT", "InvalidArgument"),
        "get_no_keys": ("INVALID_ARGUMENT", "InvalidArgument"),
    }


def test_block_keys_computed_in_javascript_from_the_protos_words_are_pythons(node):
    assert len(node["vector"]) == 2
    parent = b""
    for vector in node["vector"]:
        parent = block_key(vector["fingerprint"], parent, vector["tokens"])
        assert vector["computed"] == vector["expected"] == parent.hex()
    sent, stored = node["put"]["sent"], node["put"]["stored"]
    assert [b["token_ids"] for b in sent] == NODE_SPANS
    for block, result in zip(sent, stored, strict=True):
        key = block_key(FP, bytes.fromhex(block["parent_key"]), block["token_ids"])
        assert block["key"] == result["key"] == key.hex()
        assert result["num_tokens"] == len(block["token_ids"]) and not result["deduplicated"]


def block_dict(key: bytes, parent_key: bytes, token_ids, tensors) -> dict:
    """A block as contract.mjs prints it: keys and bytes in hex, tensors' bytes together."""
    return {
        "key": key.hex(),
        "parent_key": parent_key.hex(),
        "token_ids": list(token_ids),
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in tensors],
        "data": b"".join(memoryview(t.data).tobytes() for t in tensors).hex(),
    }


def test_blocks_put_from_node_read_in_python_and_back(node, store_address, python_blocks):
    sent = node["put"]["sent"]
    with StoreClient(store_address) as store:
        back = list(store.get_blocks(BLOCK_NS, FP, [bytes.fromhex(b["key"]) for b in sent]))
    assert [block_dict(b.key, b.parent_key, b.token_ids, b.tensors) for b in back] == sent
    blocks, keys = python_blocks
    expected = [
        block_dict(key, b.parent_key, b.token_ids, b.tensors)
        for b, key in zip(blocks, keys, strict=True)
    ]
    assert node["read"] == expected and len(expected) == 2


def test_health_checks_from_node_answer_serving(node):
    assert node["health"] == {
        "store": {"": "SERVING", "agentkv.v1.CacheStore": "SERVING"},
        "worker": {"": "SERVING", "agentkv.worker.v1.InferenceWorker": "SERVING"},
    }
