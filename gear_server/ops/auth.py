"""Authentication and transport security for the daemon: bearer tokens, TLS, mutual TLS.

With a token configured every RPC must carry ``authorization: Bearer <token>``
metadata; anything else is answered UNAUTHENTICATED before the servicer runs,
so data-plane handles (segment paths, memory keys, session ids) only ever go
to authenticated callers. The health service may stay open to probes
(``public_health``): without the token it answers only the server's overall
status (service ``""``), per-service names need the token (gear_server/ops/health.py).
TLS uses a server certificate; a client CA turns on mutual TLS. See
docs/SECURITY.md for a worked example.

The interceptor is a grpc.aio one (the daemon serves on asyncio).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from gear_server.config import ConfigError, known_keys
from gear_server.errors import shorten

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_BOOLEANS = ("require_client_cert", "public_health", "allow_insecure")


@dataclass(frozen=True)
class AuthSettings:
    """The ``[auth]`` section of the daemon's TOML config (every key optional)."""

    token: str | None = None             # the bearer token itself (prefer token_file)
    token_file: str | None = None        # a file holding the token (mode 0600 or 0400)
    tls_cert_file: str | None = None     # server certificate chain, PEM
    tls_key_file: str | None = None      # its private key, PEM
    tls_client_ca_file: str | None = None  # CA bundle for client certificates: mutual TLS
    require_client_cert: bool = True     # with a client CA: refuse clients without a certificate
    public_health: bool = True           # grpc.health.v1.Health answers without a token
    allow_insecure: bool = False         # serve a non-loopback address with neither token nor TLS

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> AuthSettings:
        """Parse and check the section; ValueError names an unknown key or a bad combination."""
        known = set(cls.__dataclass_fields__)
        section = known_keys(section, known, "[auth]")
        for key in _BOOLEANS:
            if key in section and not isinstance(section[key], bool):
                raise ValueError(f"[auth] {key} must be true or false, got {section[key]!r}")
        for key in known - set(_BOOLEANS):
            if key in section and not isinstance(section[key], str):
                raise ValueError(f"[auth] {key} must be a string, got {section[key]!r}")
        settings = cls(**section)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ValueError for settings that cannot work together."""
        if self.token is not None and self.token_file is not None:
            raise ValueError("[auth]: set token or token_file, not both")
        if self.token is not None and not self.token.strip():
            raise ValueError("[auth] token is empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("[auth]: tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("[auth]: mutual TLS (tls_client_ca_file) needs tls_cert_file and tls_key_file")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def load_token(self) -> str | None:
        """The configured token, read from token_file when given; None when tokens are off."""
        if self.token is not None:
            return self.token.strip()
        if self.token_file is None:
            return None
        path = Path(self.token_file)
        try:
            info = path.stat()
            token = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"[auth] token_file {path}: {exc.strerror or exc}") from exc
        if not token:
            raise ValueError(f"[auth] token_file {path} is empty")
        # 0600, or 0640 with the daemon's own group (root:gear as the install script makes it).
        own_group = info.st_gid == os.getgid() or info.st_gid in os.getgroups()
        if info.st_mode & stat.S_IRWXO or (info.st_mode & stat.S_IRWXG and not own_group):
            log.warning("token file %s can be read by other users (mode %o, group %d): chmod o-rwx, and give it "
                        "the daemon's group or mode 0600", path, stat.S_IMODE(info.st_mode), info.st_gid)
        return token

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS (or mutual TLS) credentials for ``add_secure_port``; None for plaintext."""
        if not self.tls:
            return None
        key = _read(self.tls_key_file, "tls_key_file")
        cert = _read(self.tls_cert_file, "tls_cert_file")
        client_ca = _read(self.tls_client_ca_file, "tls_client_ca_file") if self.tls_client_ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca,
            require_client_auth=bool(client_ca) and self.require_client_cert)

    def token_check(self) -> TokenCheck | None:
        """The check of presented tokens (None: tokens are off, every caller is trusted)."""
        token = self.load_token()
        return None if token is None else TokenCheck(token)

    def interceptors(self, on_denied: Callable[[str], None] | None = None,
                     check: TokenCheck | None = None) -> list[aio.ServerInterceptor]:
        """The server interceptors these settings need (none without a token)."""
        check = check or self.token_check()
        if check is None:
            return []
        exempt = (HEALTH_PREFIX,) if self.public_health else ()
        return [BearerTokenInterceptor(check, exempt_prefixes=exempt, on_denied=on_denied)]

    def check_exposure(self, bind_address: str) -> None:
        """Refuse (ConfigError) to serve a non-loopback address with neither token nor TLS, unless
        ``allow_insecure``: anyone who reaches the port could read, write and empty every table."""
        if self.token is not None or self.token_file is not None or self.tls or is_loopback(bind_address):
            return
        if self.allow_insecure:
            log.warning("serving %s with neither a token nor TLS (allow_insecure): anyone who reaches it can read, "
                        "write and empty every table", bind_address)
            return
        raise ConfigError(
            f"refusing to serve {bind_address} with neither a token nor TLS: anyone who reaches the port could "
            f"read, write and empty every table. Set token_file in [auth] (deploy/install-service.sh "
            f"--generate-token writes one and sets it), or TLS (docs/SECURITY.md), or bind_address = \"127.0.0.1\" "
            f"for this host only; to serve it open anyway, set allow_insecure = true in [auth] "
            f"(or --allow-insecure)")

    def describe(self) -> str:
        """One log-friendly line (never the token)."""
        parts = ["token" if (self.token or self.token_file) else "no token"]
        if self.tls_client_ca_file:
            parts.append("mutual TLS" + ("" if self.require_client_cert else " (client cert optional)"))
        elif self.tls:
            parts.append("TLS")
        else:
            parts.append("plaintext")
        if self.allow_insecure and not (self.token or self.token_file or self.tls):
            parts.append("open to every host that reaches it (allow_insecure)")
        return ", ".join(parts)


def is_loopback(bind_address: str) -> bool:
    """Whether a bind address reaches this host only (127.0.0.0/8, ::1, or a name that resolves only to them)."""
    host = bind_address.strip()
    if host.startswith("unix:"):
        return True
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _read(path: str | None, key: str) -> bytes:
    try:
        return Path(path).read_bytes()  # type: ignore[arg-type]
    except OSError as exc:
        raise ValueError(f"[auth] {key} {path}: {exc.strerror or exc}") from exc


class TokenCheck:
    """Whether call metadata carries ``authorization: Bearer <token>`` (compared in constant time)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty bearer token")
        self._expected = f"Bearer {token}".encode()

    def presented(self, metadata: Iterable[tuple[str, Any]] | None) -> bytes | None:
        for key, value in metadata or ():
            if key == "authorization":
                return value.encode() if isinstance(value, str) else value
        return None

    def accepts(self, presented: bytes | None) -> bool:
        # Constant-time comparison: the answer's timing says nothing about the token.
        return presented is not None and hmac.compare_digest(presented, self._expected)

    def authenticated(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        return self.accepts(self.presented(metadata))


class BearerTokenInterceptor(aio.ServerInterceptor):
    """Answer UNAUTHENTICATED to any call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str | TokenCheck, *, exempt_prefixes: tuple[str, ...] = (),
                 on_denied: Callable[[str], None] | None = None) -> None:
        self._check = token if isinstance(token, TokenCheck) else TokenCheck(token)
        self._exempt = exempt_prefixes
        self._on_denied = on_denied
        self._refusals: dict[tuple[str, str], grpc.RpcMethodHandler] = {}  # built once per method

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if self._exempt and method.startswith(self._exempt):
            return await continuation(handler_call_details)
        presented = self._check.presented(handler_call_details.invocation_metadata)
        if self._check.accepts(presented):
            return await continuation(handler_call_details)
        if self._on_denied is not None:
            self._on_denied(method)
        reason = "missing bearer token" if presented is None else "wrong bearer token"
        # Keyed on the shortened name: method names come from callers, so each key stays small
        # (served names are short and kept whole; two long made-up names that shorten alike are
        # both unknown methods and share one refusal) and the cache stays bounded in count.
        key = (shorten(method), reason)
        refusal = self._refusals.get(key)
        if refusal is None:
            refusal = _refusal(await continuation(handler_call_details), f"{key[0]}: {reason}")
            if len(self._refusals) > 4096:
                self._refusals.clear()
            self._refusals[key] = refusal
        return refusal


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED (reads no request)."""
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # unknown method: refused too, so callers cannot probe for method names
        return grpc.unary_unary_rpc_method_handler(abort)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](abort)
