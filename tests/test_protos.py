"""The checked-in stubs are exactly what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from agentkv.v1 import store_pb2
from agentkv.worker.v1 import worker_pb2

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regenerating_stubs_changes_nothing(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    load_generator().generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*")}
    assert fresh, "the generator wrote nothing"
    for rel, content in fresh.items():
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is not checked in; run scripts/gen_protos.py"
        assert checked_in.read_bytes() == content, f"{rel} is stale; run scripts/gen_protos.py"


@pytest.mark.parametrize(
    "module, service, proto",
    [
        (store_pb2, "CacheStore", "agentkv/v1/store.proto"),
        (worker_pb2, "InferenceWorker", "agentkv/worker/v1/worker.proto"),
    ],
)
def test_every_rpc_has_its_own_messages_and_every_field_a_comment(module, service, proto):
    for method in module.DESCRIPTOR.services_by_name[service].methods:
        assert method.input_type.name == f"{method.name}Request"
        assert method.output_type.name == f"{method.name}Response"
    lines = (ROOT / "protos" / proto).read_text().splitlines()
    field = re.compile(r"^\s+(repeated |map<[^>]+> )?[\w.<>, ]+ \w+ = \d+;")
    assert sum(bool(field.match(line)) for line in lines) > 10
    for i, line in enumerate(lines):
        if field.match(line):
            assert lines[i - 1].strip().startswith("//"), f"field without a comment: {line.strip()}"


def test_the_block_key_test_vector_in_the_proto_is_what_the_store_computes():
    """A client in another language computes keys from the proto's words and vector alone."""
    import hashlib
    import struct

    from agentkv.keys import block_key

    text = (ROOT / "protos" / "agentkv" / "v1" / "store.proto").read_text()
    vector = re.findall(r"tokens \[([\d, ]+)\] under .*-> ([0-9a-f]{64})", text)
    fingerprint = re.search(r'Test vector \(fingerprint "([^"]+)"\)', text)[1]
    assert len(vector) == 2
    parent = b""
    for tokens, expected in vector:
        ids = [int(t) for t in tokens.split(",")]
        fp = fingerprint.encode()
        spelled = hashlib.blake2b(
            b"agentkv-block-v1"
            + struct.pack("<I", len(fp))
            + fp
            + struct.pack("<I", len(parent))
            + parent
            + struct.pack(f"<{len(ids)}I", *ids),
            digest_size=32,
            person=b"agentkv",
        ).digest()
        assert spelled.hex() == expected  # the proto's description, byte for byte
        assert block_key(fingerprint, parent, ids).hex() == expected  # what the store uses
        parent = spelled


def test_the_contract_names_every_error_a_server_sends():
    """store.proto lists the names the "agentkv-error" trailer may carry: each of
    agentkv/errors.py's classes, so a client in another language can map every one."""
    from agentkv.errors import ERRORS

    text = (ROOT / "protos" / "agentkv" / "v1" / "store.proto").read_text()
    listed = text.split('"agentkv-error" names the error, one of: ')[1].split("(INTERNAL)")[0]
    names = re.findall(r"\w+", listed.replace("//", ""))
    assert sorted(names) == sorted(ERRORS) and len(set(names)) == len(names)
    # A service's own subclasses (the store's ObjectStoreDown, NamespaceHeld, ...) go on the
    # wire by the nearest listed name.
    from agentkv.errors import AgentKVError

    for module in (
        "cache_store.lock",
        "cache_store.objects",
        "cache_store.writer_leases",
        "agentkv.client.blocks",
        "agentkv.client.scenario_yaml",
        "inference_worker.chat",
    ):
        importlib.import_module(module)

    def subclasses(cls: type) -> list[type]:
        return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

    own = [c for c in subclasses(AgentKVError) if c.__name__ not in ERRORS]
    assert {"ObjectStoreDown", "Refused", "NamespaceHeld", "DataDirInUse"} <= {
        c.__name__ for c in own
    }
    for cls in subclasses(AgentKVError):
        sent = AgentKVError.trailing_metadata(cls.__new__(cls))
        assert dict(sent)["agentkv-error"] in names, cls
