"""Client side of the daemon's security: bearer-token metadata and TLS channel credentials.

``Client(address, token=..., root_certificates=..., certificate_chain=...,
private_key=...)`` builds its channel here. Reverb code that passes none of
them still reaches a secured daemon when the environment names the secrets:
``GEAR_TOKEN`` or ``GEAR_TOKEN_FILE``, ``GEAR_TLS_ROOT_CERTS`` (a PEM file;
turns TLS on), ``GEAR_TLS_CERT_CHAIN`` and ``GEAR_TLS_PRIVATE_KEY`` (mutual TLS).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

PemSource = bytes | str | os.PathLike | None


def _pem(value: PemSource, what: str) -> bytes | None:
    """PEM bytes from bytes, PEM text or a file path."""
    if value is None or isinstance(value, bytes):
        return value
    text = os.fspath(value)
    if "-----BEGIN" in text:
        return text.encode()
    try:
        return Path(text).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {text}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class ChannelSecurity:
    """What a client channel needs to pass the daemon's checks."""

    token: str | None = None
    root_certificates: bytes | None = None   # CA that signed the daemon's certificate; TLS on when set
    certificate_chain: bytes | None = None   # client certificate (mutual TLS)
    private_key: bytes | None = None
    tls: bool = False

    @classmethod
    def build(cls, *, token: str | None = None, root_certificates: PemSource = None,
              certificate_chain: PemSource = None, private_key: PemSource = None,
              tls: bool | None = None, use_env: bool = True) -> ChannelSecurity:
        """Explicit arguments first, then the GEAR_* environment variables (when use_env)."""
        env = os.environ if use_env else {}
        if token is None and env.get("GEAR_TOKEN"):
            token = env["GEAR_TOKEN"]
        if token is None and env.get("GEAR_TOKEN_FILE"):
            token = Path(env["GEAR_TOKEN_FILE"]).read_text()
        if token is not None:
            token = token.strip()
            if not token:
                raise ValueError("token is empty")
        root_certificates = root_certificates if root_certificates is not None else env.get("GEAR_TLS_ROOT_CERTS")
        certificate_chain = certificate_chain if certificate_chain is not None else env.get("GEAR_TLS_CERT_CHAIN")
        private_key = private_key if private_key is not None else env.get("GEAR_TLS_PRIVATE_KEY")
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together (mutual TLS)")
        roots = _pem(root_certificates, "root_certificates")
        chain = _pem(certificate_chain, "certificate_chain")
        key = _pem(private_key, "private_key")
        use_tls = bool(tls) or roots is not None or chain is not None
        return cls(token=token, root_certificates=roots, certificate_chain=chain, private_key=key, tls=use_tls)

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to ``target``: TLS when configured, token metadata on every call."""
        if self.tls:
            credentials = grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                                       self.certificate_chain)
            channel = grpc.secure_channel(target, credentials, options=list(options))
        else:
            channel = grpc.insecure_channel(target, options=list(options))
        if self.token is not None:
            channel = grpc.intercept_channel(channel, BearerTokenMetadata(self.token))
        return channel

    def aio_channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to ``target`` (call it on the loop that will drive it): TLS when configured; the
        token goes with each call as ``call_metadata``."""
        if self.tls:
            credentials = grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                                       self.certificate_chain)
            return grpc.aio.secure_channel(target, credentials, options=list(options))
        return grpc.aio.insecure_channel(target, options=list(options))

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Metadata for each call on an ``aio_channel`` (the bearer token), None without a token."""
        return None if self.token is None else (("authorization", f"Bearer {self.token}"),)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class BearerTokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call on a channel (plaintext or TLS)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
