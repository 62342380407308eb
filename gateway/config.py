"""The gateway process's configuration, filled once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv import defaults, ids
from agentkv.addresses import client_address, is_loopback, listen_host
from agentkv.channels import ClientSecurity
from agentkv.flags import flag, nested
from agentkv.security import ServerSecurity
from agentkv.serving import check_address_file, log_level_flag
from agentkv.units import parse_bytes

INFO_TIMEOUT = 5.0  # seconds a worker gets to answer a health, model or feature check


@dataclass(slots=True)
class GatewayConfig:
    workers: list[str] = flag(
        help="worker address, HOST:PORT (repeat for several: agents are routed among them)",
        name="worker",
        action="append",
        factory=list,
    )
    store: str = flag("", "cache store address, for GET /v1/agents (the namespace's agents)")
    listen: str = flag(defaults.GATEWAY_ADDRESS, "HOST:PORT to serve HTTP on (port 0 picks one)")
    namespace: str = flag(
        ids.DEFAULT_NAMESPACE, "namespace of a request that names none (X-Namespace header)"
    )
    model_name: str = flag("", "the model id clients ask for", shown="the workers' --model")
    max_tokens: int = flag(
        512,
        "max_tokens of a request that gives none, lowered to the room its context has left",
    )
    max_body_bytes: int = flag(
        8 << 20,
        "largest request body (413 past it)",
        name="max-body",
        parse=parse_bytes,
        shown="8M",
    )
    timeout: float = flag(300.0, "seconds a turn may take on a worker")
    cleanup_seconds: float = flag(
        30.0,
        "seconds a stop waits, after the drain, to delete the spare agents its calls made "
        "(those left then are named in the log)",
    )
    log_level: str = log_level_flag()
    address_file: str = flag("", "once serving, write the bound address to this file as JSON")
    security: ServerSecurity = nested(ServerSecurity)  # its clients: TLS, the token table
    upstream: ClientSecurity = nested(ClientSecurity, prefix="upstream-")  # to the services

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one --worker HOST:PORT is needed")
        if repeated := sorted({w for w in self.workers if self.workers.count(w) > 1}):
            raise ValueError(f"--worker {', '.join(repeated)} is given more than once")
        check_address_file(self.address_file)
        dialed = [("--worker", worker) for worker in self.workers]
        if self.store:  # none: GET /v1/agents is a 404
            dialed.append(("--store", self.store))
        for name, address in dialed:  # checked as the CLI and the worker check theirs
            try:
                client_address(address)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if listen_host(self.listen) is None:
            raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
        if not ids.NAMESPACE_RE.fullmatch(self.namespace):
            raise ValueError(
                f"--namespace {self.namespace!r} must match {ids.NAMESPACE_RE.pattern}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not self.timeout > 0:  # every call would end at once, 504 (or 503 if negative)
            raise ValueError(f"--timeout must be above 0 seconds, got {self.timeout}")
        if self.cleanup_seconds < 0:
            raise ValueError(f"--cleanup-seconds must be 0 or more, got {self.cleanup_seconds}")
        if self.max_body_bytes < 1024:  # the smallest chat request would be a 413
            raise ValueError(f"--max-body must be at least 1K, got {self.max_body_bytes}")
        self.security.check(self.listen, is_loopback(self.listen))
