"""agentkv-gateway: OpenAI's chat-completions and Responses APIs (POST /v1/chat/completions,
POST /v1/responses, GET /v1/models), Anthropic's Messages API (POST /v1/messages) and
GET /health in front of agentkv workers. Each agent's Q4 KV cache persists in the store: a
client that resends its whole history prefills only what is new."""

from __future__ import annotations

if __name__ == "__main__":  # python -m: its imports below run as the console script's do
    from agentkv.entry import gateway

    gateway()
    raise SystemExit

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from agentkv import logs
from agentkv.addresses import bound_socket, is_loopback
from agentkv.flags import parse_config
from agentkv.gateway.app import create_app
from agentkv.gateway.config import GatewayConfig
from agentkv.serving import AddressFile

log = logging.getLogger("agentkv.gateway")


class Server(uvicorn.Server):
    """uvicorn's server, logging the "serving" event with the address it bound."""

    def __init__(
        self, config: uvicorn.Config, gateway: GatewayConfig, address_file: AddressFile
    ) -> None:
        super().__init__(config)
        self.gateway, self.address_file = gateway, address_file

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets
        facts = {"address": address, "workers": self.gateway.workers, "store": self.gateway.store}
        # before "serving", as the services write theirs
        self.address_file.write(json.dumps({"address": address}))
        log.info("serving", extra=facts)

    async def shutdown(self, sockets=None) -> None:
        log.info("stopping")
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT stop the gateway gracefully, as they stop the store and the
        worker, and that is the end of them: uvicorn's own raises the signal again once
        stopped (a traceback for SIGINT, death by SIGTERM)."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv: list[str] | None = None, prog: str = "agentkv-gateway") -> None:
    """`prog`: the command the user typed (`agentkv gateway` runs this too)."""
    config = parse_config(GatewayConfig, prog, __doc__, argv)
    logs.configure(config.log_level)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.setLevel(logging.WARNING)  # "serving" says it started
    uvicorn_log.addFilter(_cut_by_the_stop)
    for warning in config.security.warnings(config.listen, is_loopback(config.listen), None):
        log.warning(warning)
    address_file = AddressFile(config.address_file)
    try:
        address_file.clear_stale()  # what a script finds is this run's
        app = create_app(config)  # reads the token table
        listener = bound_socket(config.listen)
        serve(Server(server_config(app, config), config, address_file), listener)
    except (ValueError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # before it serves: once it does, SIGINT stops it gracefully
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        address_file.remove()


def _cut_by_the_stop(record: logging.LogRecord) -> bool:
    """uvicorn's "Cancel N running task(s), timeout graceful shutdown exceeded" is a stop's
    designed end (those replies end with 503, send it again), at its error level: a warning,
    as the worker's "turns cut by the stop"."""
    if "timeout graceful shutdown exceeded" in str(record.msg):
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def server_config(app, config: GatewayConfig) -> uvicorn.Config:
    tls = config.security
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        ssl_certfile=tls.tls_cert or None,
        ssl_keyfile=tls.tls_key or None,
        ssl_ca_certs=tls.tls_client_ca or None,
        ssl_cert_reqs=2 if tls.tls_client_ca else 0,  # ssl.CERT_REQUIRED with a client CA
    )


def serve(server: Server, listener: socket.socket) -> None:
    with listener:
        asyncio.run(server.serve(sockets=[listener]))
