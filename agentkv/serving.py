"""What both services share: the config fields (where they listen, metrics, health, logs,
RPC threads and security, each flag defined once: agentkv.flags) and the server bootstrap
(interceptors, health, reflection, metrics, a graceful stop on SIGTERM)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry, Counter

from agentkv.addresses import is_loopback, listen_host, tcp_listen
from agentkv.flags import flag, nested
from agentkv.rpc import (
    StopSignals,
    add_health_and_reflection,
    bind,
    check_bindable,
    new_server,
    start_health,
    start_metrics,
)
from agentkv.security import ServerSecurity

LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical")  # logging's names
STOP_SLACK_SECONDS = 5.0  # past the grace, for gRPC to end the calls it cancelled
rpc_log = logging.getLogger("agentkv.rpc")


def log_level_flag() -> Any:
    """The --log-level field, in any case (INFO, info); argparse refuses any other level in
    one line."""
    return flag("info", "how much to log", parse=str.lower, choices=LOG_LEVELS)


def listen_flag(default: str) -> Any:
    """The --listen field, with the service's own default address (keyword-only, where
    ServerConfig declares it)."""
    return flag(default, "HOST:PORT (port 0 picks one) or unix:/path/to.sock", kw_only=True)


@dataclass(kw_only=True)
class ServerConfig:
    """The fields every service has; a subclass adds `listen = listen_flag(ITS_ADDRESS)`."""

    listen: str
    # An empty value is off, as absent: a unit file passes a variable set to nothing.
    metrics_listen: str | None = flag(
        None, "HOST:PORT for Prometheus metrics (empty: none)", convert=lambda v: v or None
    )
    health_listen: str | None = flag(
        None,
        "HOST:PORT serving only grpc.health.v1, plaintext and open (kubelet's grpc probe; "
        "empty: none)",
        convert=lambda v: v or None,
    )
    log_level: str = log_level_flag()
    workers: int = flag(16, "RPC threads")
    address_file: str = flag(
        "",
        "once serving, write the bound addresses (address, metrics, health: what the "
        '"serving" log line has) to this file as JSON, for scripts that listen on port 0',
    )
    security: ServerSecurity = nested(ServerSecurity)

    def check_serving(self) -> None:
        """Refuses addresses that cannot be served and unsafe security (ServerSecurity.check)."""
        listen_host(self.listen)
        check_address_file(self.address_file)
        tcp_listen("metrics_listen", self.metrics_listen)
        tcp_listen("health_listen", self.health_listen)
        self.security.check(self.listen, self.is_loopback)

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.listen)

    def security_warnings(self) -> list[str]:
        return self.security.warnings(self.listen, self.is_loopback, self.metrics_listen)


class ServiceMetrics(Protocol):
    registry: CollectorRegistry
    rpc_errors: Counter


@dataclass(slots=True)
class Served:
    """A service's gRPC server, bound and not yet started (`serve_until_signal` runs it)."""

    server: grpc.Server
    address: str  # what clients dial: host:port with the bound port, or unix:path
    health: health.HealthServicer
    metrics: ServiceMetrics
    close: Callable[[], None]  # releases the service once its server has stopped
    grace: float  # seconds in-flight calls get to finish at a stop

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        if not self.server.stop(self.grace).wait(self.grace + STOP_SLACK_SECONDS):
            rpc_log.warning("server not stopped after its grace: closing anyway")
        self.close()


def bind_service(
    config: ServerConfig,
    service: str,
    handlers: grpc.GenericRpcHandler,
    metrics: ServiceMetrics,
    close: Callable[[], None],
    *,
    max_message_bytes: int,
    grace: float,
) -> Served:
    """One server bootstrap for both services: the error interceptor (counting errors in
    `metrics`) behind the auth interceptor, message limits, health and reflection, bound to
    `config.listen` with its TLS. A failed bind calls `close` and raises OSError."""
    server = new_server(
        config.workers,
        max_message_bytes,
        lambda code: metrics.rpc_errors.labels(code.name).inc(),
        config.security.interceptors(),
    )
    server.add_generic_rpc_handlers((handlers,))
    health_servicer = add_health_and_reflection(server, service)
    try:
        address = bind(server, config.listen, config.security.credentials())
    except OSError:
        close()
        raise
    return Served(server, address, health_servicer, metrics, close, grace)


def serve_until_signal(
    config: ServerConfig, create: Callable[[], Served], log: logging.Logger, **facts: Any
) -> None:
    """Logs the security warnings, creates and starts the server, its metrics and health
    endpoints, logs "serving" (with `facts`), and on SIGTERM or SIGINT drains and stops."""
    for warning in config.security_warnings():
        log.warning(warning, extra={"listen": config.listen})
    address_file = AddressFile(config.address_file)
    address_file.clear_stale()  # what a script finds is this run's
    check_bindable(config.listen)  # before the data dir is made or the model loads
    served = create()
    health_server = None
    try:  # whatever fails from here, the index is closed and no stale address is left
        signals = StopSignals()  # before "serving": a SIGTERM right after it still drains
        metrics = start_metrics(config.metrics_listen, served.metrics.registry)
        served.server.start()
        health_server, health_address = start_health(config.health_listen, served.health)
        extra = {"address": served.address, **facts, "metrics": metrics, "health": health_address}
        address_file.write(json.dumps(extra) + "\n")
        log.info("serving", extra=extra)
        signals.wait()
        log.info("stopping")
    finally:
        served.stop()
        if health_server is not None:
            health_server.stop(0)
        address_file.remove()


def check_address_file(name: str) -> None:
    """--address-file NAME: a file this service may write, and remove at its start (an
    earlier run's address, which a script must not read) and at its end; a folder, or a
    file that is no address file (a JSON object with an "address"), is never removed."""
    if not name:
        return
    path = Path(name)
    if not path.parent.is_dir():
        why = "is not a folder" if path.parent.exists() else "does not exist"
        raise ValueError(f"--address-file {name}: its folder {path.parent} {why}")
    if path.is_dir():
        raise ValueError(f"--address-file {name} is a folder: name a file in it")
    if not path.exists() or not path.stat().st_size:  # an empty one: made for it (mktemp)
        return
    try:
        written = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        written = None
    if not (isinstance(written, dict) and "address" in written):
        raise ValueError(
            f"--address-file {name} holds a file that is no address file (JSON with an "
            '"address"), which the service would remove: name a file of its own'
        )


class AddressFile:
    """--address-file: where a service writes the addresses it serves at, for scripts to
    read. An earlier run's is removed as this one starts, unless a service still answers
    at the address it names: a second start of a service, refused next (its data dir or
    port in use), removed the running one's file, and a script could no longer find it.
    At the stop, only the file this run wrote is removed, not one a later run wrote."""

    def __init__(self, name: str) -> None:
        self.path = Path(name) if name else None
        self.written: str | None = None

    def clear_stale(self) -> None:
        if self.path is None:
            return
        try:
            address = json.loads(self.path.read_text()).get("address")
        except (OSError, ValueError, AttributeError):  # none, or no address file's
            address = None
        if not (isinstance(address, str) and answers(address)):
            self.path.unlink(missing_ok=True)

    def write(self, text: str) -> None:
        if self.path is not None:
            write_atomically(self.path, text)
            self.written = text

    def remove(self) -> None:
        if self.path is None or self.written is None:
            return
        with contextlib.suppress(OSError):
            if self.path.read_text() == self.written:
                self.path.unlink()


def answers(address: str) -> bool:
    """Whether something accepts a connection at HOST:PORT or unix:PATH now."""
    try:
        if address.startswith("unix:"):
            path = address.removeprefix("unix:").removeprefix("//")
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(1.0)
                sock.connect(path)
        else:
            host, _, port = address.rpartition(":")
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return False
    return True


def write_atomically(path: Path, text: str) -> None:
    """`text` in `path` whole or not at all: a reader never sees half of it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    partial.write_text(text)
    os.replace(partial, path)
