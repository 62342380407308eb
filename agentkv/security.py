"""A server's TLS and token settings from its flags, shared by the store and the worker:
what they refuse, what they warn about, and the interceptors and credentials they serve with.

TLS: `--tls-cert` and `--tls-key` serve TLS; `--tls-client-ca` also requires client
certificates signed by that CA (mTLS). Tokens: agentkv.auth. Clients: agentkv.channels, whose
TLS files are checked here too (check_tls_files).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from agentkv.addresses import is_loopback
from agentkv.auth import AuthInterceptor, TokenTable
from agentkv.flags import check_files, flag


def server_credentials(cert: str, key: str, client_ca: str | None = None):
    """TLS for a server; with `client_ca`, clients must present a certificate it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=bool(ca))


def check_tls_files(config: Any, cert: str, key: str, ca: str) -> None:
    """The TLS files that the fields named `cert`, `key` and `ca` of `config` give (those
    set) hold what gRPC will load: certificates, and the certificate's own unencrypted key.
    A bad one is a usage error naming its flag, found with the flags: gRPC reads them only
    when it serves (a server then says it could not bind) or dials."""
    check_files(config, (cert, key, ca))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # What the files hold, not how strong it is: gRPC's own TLS takes a 1024-bit RSA key or a
    # SHA-1 signature, which Python's default security level would refuse here.
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    for name in (cert, ca):
        if path := getattr(config, name):
            try:
                context.load_verify_locations(cafile=path)
            except ssl.SSLError:
                raise ValueError(f"{_flag(name)} {path}: no PEM certificate in it") from None
    if getattr(config, cert):
        _check_key(context, _flag(cert), getattr(config, cert), _flag(key), getattr(config, key))


def _check_key(context: ssl.SSLContext, cert_flag: str, cert: str, key_flag: str, key: str) -> None:
    """`key` is the private key of `cert`, unencrypted (gRPC takes no passphrase)."""
    try:
        context.load_cert_chain(cert, key, password=b"")  # b"": no prompt for an encrypted key
    except ssl.SSLError as exc:
        if exc.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):  # or its type
            raise ValueError(
                f"{key_flag} {key} is not the private key of {cert_flag} {cert}"
            ) from None
        raise ValueError(f"{key_flag} {key}: no unencrypted PEM private key in it") from None


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """A server's TLS files and token table, from its flags."""

    tls_cert: str = flag("", "PEM certificate: serve TLS")
    tls_key: str = flag("", "PEM private key of --tls-cert")
    tls_client_ca: str = flag("", "PEM CA: require client certificates")
    auth_tokens: str = flag("", "JSON token table: bearer tokens and their namespaces")
    allow_unauthenticated: bool = flag(
        False, "serve beyond loopback with no tokens (logged as a warning at start)"
    )
    allow_plaintext_tokens: bool = flag(
        False, "accept bearer tokens beyond loopback without TLS (logged as a warning at start)"
    )

    def check(self, listen: str, loopback: bool) -> None:
        """Safe defaults: no authentication only on loopback, and bearer tokens beyond
        loopback only over TLS, unless asked for loudly."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        check_tls_files(self, "tls_cert", "tls_key", "tls_client_ca")
        check_files(self, ("auth_tokens",))
        if self.auth_tokens:
            TokenTable.load(self.auth_tokens)  # a bad table stops the flags, before any loading
        if not loopback and not self.auth_tokens and not self.allow_unauthenticated:
            raise ValueError(
                f"listening on {listen} (beyond loopback) needs --auth-tokens FILE; "
                "--allow-unauthenticated serves anyone who can reach it"
            )
        plaintext = not loopback and self.auth_tokens and not self.tls_cert
        if plaintext and not self.allow_plaintext_tokens:
            raise ValueError(
                f"listening on {listen} (beyond loopback) with bearer tokens needs TLS "
                "(--tls-cert, --tls-key): without it every token crosses the network in "
                "clear; --allow-plaintext-tokens serves them anyway"
            )

    def warnings(self, listen: str, loopback: bool, metrics_listen: str | None) -> list[str]:
        """What a start-up log should shout about: settings that are allowed but exposed."""
        found = []
        if not loopback and not self.auth_tokens:
            found.append(
                f"LISTENING BEYOND LOOPBACK WITH NO AUTHENTICATION: anyone who can reach {listen} "
                "can read and write every namespace"
            )
        if not loopback and self.auth_tokens and not self.tls_cert:
            found.append(f"BEARER TOKENS IN CLEAR TEXT: {listen} serves tokens without TLS")
        if metrics_listen and not is_loopback(metrics_listen):
            found.append(
                f"METRICS BEYOND LOOPBACK: {metrics_listen} serves unauthenticated HTTP "
                "(counts, sizes and timings) to anyone who can reach it"
            )
        if self.auth_tokens:
            # A group may read it (Kubernetes mounts Secrets 0440 for fsGroup), not write it.
            mode = Path(self.auth_tokens).stat().st_mode & 0o777
            if mode & 0o007:
                found.append(
                    f"TOKEN FILE READABLE BY OTHERS: {self.auth_tokens} has mode {mode:o}; "
                    f"chmod 600 it (640 shares it with one group)"
                )
            elif mode & 0o020:
                found.append(
                    f"TOKEN FILE WRITABLE BY ITS GROUP: {self.auth_tokens} has mode {mode:o}; "
                    f"chmod 640 it"
                )
        return found

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [AuthInterceptor(TokenTable.load(self.auth_tokens))] if self.auth_tokens else []

    def credentials(self):
        if not self.tls_cert:
            return None
        return server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca or None)
