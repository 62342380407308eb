#!/usr/bin/env python3
"""agentkv-health: exits 0 when a server's grpc.health.v1 answers SERVING, 1 otherwise.

The container probe for agentkv-store and agentkv-worker (the image installs it as
/usr/local/bin/agentkv-health). Kubelet's native `grpc:` probe speaks plaintext only, and
both services serve TLS in these deployments; this probe speaks TLS (and mTLS) and needs no
token, since health checks are exempt from --auth-tokens.

    agentkv-health [--service NAME] [--tls-ca PEM [--server-name NAME]]
                   [--tls-cert PEM --tls-key PEM] [--timeout SECONDS] HOST:PORT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="agentkv-health", description=__doc__.split("\n")[0])
    p.add_argument("address", help="HOST:PORT or unix:PATH of the server")
    p.add_argument("--service", default="", help='service name to ask about ("" = the server)')
    p.add_argument("--tls-ca", default="", help="PEM CA the server's certificate chains to")
    p.add_argument("--tls-cert", default="", help="PEM client certificate (mTLS)")
    p.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    p.add_argument(
        "--server-name",
        default="",
        help="name to verify the certificate against, when it differs from the dialled host",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    a = p.parse_args(argv)
    if bool(a.tls_cert) != bool(a.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if (a.tls_cert or a.server_name) and not a.tls_ca:
        p.error("--tls-cert and --server-name need --tls-ca")
    return a


def open_channel(a: argparse.Namespace) -> grpc.Channel:
    if not a.tls_ca:
        return grpc.insecure_channel(a.address)
    credentials = grpc.ssl_channel_credentials(
        Path(a.tls_ca).read_bytes(),
        Path(a.tls_key).read_bytes() if a.tls_key else None,
        Path(a.tls_cert).read_bytes() if a.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", a.server_name)] if a.server_name else []
    return grpc.secure_channel(a.address, credentials, options=options)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    request = health_pb2.HealthCheckRequest(service=a.service)
    try:
        with open_channel(a) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=a.timeout)
    except OSError as exc:
        print(f"agentkv-health: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"agentkv-health: {a.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if reply.status != SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"agentkv-health: {a.address} {a.service!r}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
