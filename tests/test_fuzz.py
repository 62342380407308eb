"""Every RPC of both services, fuzzed with hypothesis: random bytes where a message should be,
and well-formed messages whose every field holds a random value (ids with odd characters,
extreme integers, NaN floats, empty and oversized lists). Each call gets a precise status —
never INTERNAL or UNKNOWN — and the servers keep serving."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.launch import store_process, worker_process
from agentkv.v1 import store_pb2
from agentkv.worker.v1 import worker_pb2

IMPRECISE = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure repeats
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ODD_TEXT = st.sampled_from(
    ["", "default", "a", "A-1", "../../etc", "x" * 300, "\x00", "é", "ns with spaces", "*"]
)


def field_values(f, depth: int):
    if f.type == F.TYPE_MESSAGE:
        if f.message_type.GetOptions().map_entry:
            key, value = (
                f.message_type.fields_by_name["key"],
                f.message_type.fields_by_name["value"],
            )
            return st.dictionaries(scalar(key), scalar(value), max_size=3)
        inner = messages(f.message_type, depth + 1) if depth < 2 else st.none()
        return st.lists(inner, max_size=3) if f.is_repeated else inner
    return st.lists(scalar(f), max_size=5) if f.is_repeated else scalar(f)


def scalar(f):
    t = f.type
    if t == F.TYPE_STRING:
        return st.one_of(ODD_TEXT, st.text(max_size=40))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=48)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if t == F.TYPE_FLOAT else 64)
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    bits = 64 if t in (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64) else 32
    if t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        return st.one_of(st.integers(0, 300), st.integers(0, 2**bits - 1))
    return st.one_of(st.integers(-5, 300), st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1))


def messages(descriptor, depth: int = 0):
    fields = {f.name: field_values(f, depth) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda d: build(descriptor, d))


def build(descriptor, values: dict):
    from google.protobuf import message_factory

    message = message_factory.GetMessageClass(descriptor)()
    for name, value in values.items():
        f = descriptor.fields_by_name[name]
        if value is None:
            continue
        target = getattr(message, name)
        if f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            target.update(value)
        elif f.is_repeated and f.type == F.TYPE_MESSAGE:
            for item in value:
                if item is not None:
                    target.add().CopyFrom(item)
        elif f.is_repeated:
            target.extend(value)
        elif f.type == F.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def requests(method):
    """Bytes for one request: a random well-formed message, or random bytes."""
    return st.one_of(
        messages(method.input_type).map(lambda m: m.SerializeToString()),
        st.binary(max_size=64),
    )


def call(channel, service: str, method, payloads: list[bytes]) -> grpc.StatusCode:
    path = f"/{service}/{method.name}"
    try:
        if method.client_streaming:
            stub = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            stub(iter(payloads), timeout=20)
        elif method.server_streaming:
            stub = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            for _ in stub(payloads[0], timeout=20):
                pass
        else:
            stub = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            stub(payloads[0], timeout=20)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-store")
    proc = store_process(root / "data", root / "store.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def worker(store, tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-worker")
    proc = worker_process(
        str(tiny_model_dirs["llama"]),
        store.address,
        root / "worker.log",
        extra_args=["--block-tokens", "64", "--queue-limit", "4"],
    ).start()
    yield proc
    proc.stop()


STORE = store_pb2.DESCRIPTOR.services_by_name["CacheStore"]
WORKER = worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"]


@pytest.mark.parametrize("method", list(STORE.methods), ids=lambda m: m.name)
def test_store_rpcs_answer_fuzz_precisely(store, method):
    with grpc.insecure_channel(store.address) as channel:

        @SETTINGS
        @given(st.lists(requests(method), min_size=1, max_size=3))
        def fuzz(payloads):
            code = call(channel, STORE.full_name, method, payloads)
            assert code not in IMPRECISE, (method.name, code, payloads)

        fuzz()
    assert store.running


@pytest.mark.parametrize("method", list(WORKER.methods), ids=lambda m: m.name)
def test_worker_rpcs_answer_fuzz_precisely(worker, method):
    with grpc.insecure_channel(worker.address) as channel:

        @SETTINGS
        @given(st.lists(requests(method), min_size=1, max_size=1))
        def fuzz(payloads):
            code = call(channel, WORKER.full_name, method, payloads)
            assert code not in IMPRECISE, (method.name, code, payloads)

        fuzz()
    assert worker.running
