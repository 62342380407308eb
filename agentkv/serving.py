"""What both services' configs share: where they listen, metrics, health, logs and security,
each flag defined once (agentkv.flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentkv.addresses import is_loopback, listen_host, tcp_listen
from agentkv.flags import flag, nested
from agentkv.security import ServerSecurity


def listen_flag(default: str) -> Any:
    """The --listen field, with the service's own default address (keyword-only, where
    ServerConfig declares it)."""
    return flag(default, "HOST:PORT (port 0 picks one) or unix:/path/to.sock", kw_only=True)


@dataclass(kw_only=True)
class ServerConfig:
    """The fields every service has; a subclass adds `listen = listen_flag(ITS_ADDRESS)`."""

    listen: str
    metrics_listen: str | None = flag(None, "HOST:PORT for Prometheus metrics")
    health_listen: str | None = flag(
        None, "HOST:PORT serving only grpc.health.v1, plaintext and open (kubelet's grpc probe)"
    )
    log_level: str = flag("info", "debug, info, warning or error")
    security: ServerSecurity = nested(ServerSecurity)

    def check_serving(self) -> None:
        """Refuses addresses that cannot be served and unsafe security (ServerSecurity.check)."""
        listen_host(self.listen)
        tcp_listen("metrics_listen", self.metrics_listen)
        tcp_listen("health_listen", self.health_listen)
        self.security.check(self.listen, self.is_loopback)

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.listen)

    def security_warnings(self) -> list[str]:
        return self.security.warnings(self.listen, self.is_loopback, self.metrics_listen)
