"""Addresses, to listen on or to dial: HOST:PORT or unix:PATH, checked, and whether they stay
on this machine."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback_host(host: str) -> bool:
    """True for a loopback IP or `localhost`; False for any other host, wildcards included."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def is_loopback(address: str) -> bool:
    """True for a unix socket or a loopback host: this machine only."""
    host = listen_host(address)
    return host is None or is_loopback_host(host)


def tcp_listen(name: str, listen: str | None) -> None:
    """Checks an optional HOST:PORT setting (no unix sockets); ValueError naming it."""
    if listen is not None and listen.startswith("unix:"):
        raise ValueError(f"{name} must be HOST:PORT, got {listen!r}")
    if listen is not None:
        listen_host(listen)


def listen_host(listen: str) -> str | None:
    """The host part of a listen address; None for a unix socket. Raises ValueError if malformed."""
    if listen != listen.strip() or any(c.isspace() for c in listen):
        raise ValueError(f"an address holds no spaces, got {listen!r}")
    scheme, sep, rest = listen.partition("://")
    if sep and scheme in ("http", "https", "grpc", "grpcs"):  # gRPC's own targets pass
        raise ValueError(
            f"an address is HOST:PORT or unix:PATH, not a {scheme}:// URL: got {listen!r} "
            f"(give {rest.rstrip('/')})"
        )
    if listen.startswith("unix:"):
        if len(listen) <= len("unix:"):
            raise ValueError("unix socket address needs a path: unix:/path/to.sock")
        if listen.startswith("unix://") and not listen.startswith("unix:///"):
            raise ValueError(  # gRPC reads unix://NAME as a host: no path it can dial
                f"{listen!r} names no socket path: give unix:PATH (relative or absolute) or "
                f"unix:///ABSOLUTE/PATH (unix:{listen[len('unix://') :]})"
            )
        return None
    host, sep, port = listen.rpartition(":")
    if _ipv6(listen) or _ipv6(host):
        raise ValueError(
            f"an IPv6 address goes in brackets, then its port: [{host if _ipv6(host) else listen}]"
            f":PORT, got {listen!r}"
        )
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"an address must be HOST:PORT or unix:PATH, got {listen!r}")
    return host


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def client_address(address: str) -> str:
    """`address`, checked as listen_host checks one: what a client is given to dial (a gRPC
    target such as dns:///HOST:PORT passes too). Raises ValueError if malformed."""
    listen_host(address)
    return address


def bound_socket(listen: str) -> socket.socket:
    """A socket bound to HOST:PORT (port 0 picks one), as a server binds one (SO_REUSEADDR),
    for it to listen on; OSError "could not bind HOST:PORT: WHY" when it cannot be bound."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    sock = None
    try:  # the socket itself fails where there is no IPv6, say
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise OSError(f"could not bind {listen}: {exc.strerror or exc}") from None
    return sock
