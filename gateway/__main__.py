"""agentkv-gateway: OpenAI's chat-completions API (POST /v1/chat/completions, GET /v1/models,
GET /health) in front of agentkv workers. Each agent's Q4 KV cache persists in the store:
a client that resends its whole history prefills only what is new."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import uvicorn

from agentkv import logs
from agentkv.flags import parse_config
from agentkv.gateway.app import create_app
from agentkv.gateway.config import GatewayConfig
from agentkv.serving import write_atomically

log = logging.getLogger("agentkv.gateway")


class Server(uvicorn.Server):
    """uvicorn's server, logging the "serving" event with the address it bound."""

    def __init__(self, config: uvicorn.Config, gateway: GatewayConfig) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        address = f"{host}:{port}"
        facts = {"address": address, "workers": self.gateway.workers, "store": self.gateway.store}
        log.info("serving", extra=facts)
        if self.gateway.address_file:
            write_atomically(Path(self.gateway.address_file), json.dumps({"address": address}))


def main(argv: list[str] | None = None) -> None:
    config = parse_config(GatewayConfig, "agentkv-gateway", __doc__, argv)
    logs.configure(config.log_level)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # "serving" says it started
    for warning in config.security.warnings(config.listen, False, None)[1:]:
        log.warning(warning)
    try:
        app = create_app(config)  # reads the token table
    except (ValueError, OSError) as exc:
        print(f"agentkv-gateway: error: {exc}", file=sys.stderr)
        sys.exit(2)
    host, _, port = config.listen.rpartition(":")
    tls = config.security
    server_config = uvicorn.Config(
        app,
        host=host.strip("[]"),
        port=int(port),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        ssl_certfile=tls.tls_cert or None,
        ssl_keyfile=tls.tls_key or None,
        ssl_ca_certs=tls.tls_client_ca or None,
        ssl_cert_reqs=2 if tls.tls_client_ca else 0,  # ssl.CERT_REQUIRED with a client CA
    )
    asyncio.run(Server(server_config, config).serve())


if __name__ == "__main__":
    main()
