"""Securing the gRPC port: TLS and mutual TLS, bearer-token (API key) authentication, message size limits, and the
matching client side (channels for the CLI, the health probe and benchmarks).

Server: `ServerSecurity.from_args` turns the serve flags into credentials, interceptors and channel options for the one
grpc.aio server. API keys are checked by `ApiKeyInterceptor` on every RPC except the ones a load balancer or an
operator's tooling needs without a key: `grpc.health.v1.Health`, server reflection, TorchServe's `Ping` and KServe's
`ServerLive` / `ServerReady` (health only). Behind it, `api/boundary.py`'s `RequestBoundaryInterceptor` parses
every request and turns what escapes a handler into a clear status.

Client: `ChannelSecurity` describes how to dial a server (TLS roots, client certificate, server name, API key) and
`open_channel` builds the channel. An API key is sent as call credentials, which gRPC only sends over TLS or to a
loopback address, so a key never travels in clear text to another host.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from ringserve.formats.cli_env import env_default, env_help, parse_bool
from ringserve.frontend.api.boundary import RequestBoundaryInterceptor

DEFAULT_MAX_MESSAGE_MIB = 64
# Services answered without an API key: probes and tooling need them, and they reveal no model output.
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
OPEN_METHODS = ("/org.pytorch.serve.grpc.inference.InferenceAPIsService/Ping",
                "/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady")

_BEARER = "bearer"


class SecurityConfigError(ValueError):
    """A TLS or API key setting that cannot be used; the message names the flag to change."""


# -- API keys -------------------------------------------------------------------------------------------------------


def parse_api_keys(text: str, source: str) -> list[str]:
    """Keys from a comma- or newline-separated list (blank entries and `#` comment lines skipped)."""
    keys: list[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for entry in line.split(","):
            key = entry.strip()
            if not key:
                continue
            if not all(0x21 <= ord(ch) <= 0x7E for ch in key):
                raise SecurityConfigError(f"{source}: an API key may only hold printable ASCII characters without "
                                          "spaces (it travels in an HTTP/2 header)")
            keys.append(key)
    return keys


def load_api_keys(keys: str, key_file: str) -> tuple[str, ...]:
    """Every key of `--api-key` (comma-separated) and of `--api-key-file` (one or more per line), deduplicated."""
    found = parse_api_keys(keys, "--api-key") if keys else []
    if key_file:
        found += parse_api_keys(_read_text(key_file, "--api-key-file"), f"--api-key-file {key_file}")
        if not found:
            raise SecurityConfigError(f"--api-key-file {key_file}: no key in the file")
    return tuple(dict.fromkeys(found))


def _key_digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of the keys' lengths too.
    return hashlib.sha256(key.encode()).digest()


def bearer_token(metadata: Sequence[Any] | None) -> str | None:
    """The value of the `authorization` metadata entry, or None when there is none."""
    for entry in metadata or ():
        key, value = entry[0], entry[1]
        if key.lower() == "authorization":
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs without `authorization: Bearer <one of the keys>` with UNAUTHENTICATED, before the request is
    read. Health checking, reflection and TorchServe's Ping stay open."""

    def __init__(self, keys: Sequence[str], open_services: Sequence[str] = OPEN_SERVICES,
                 open_methods: Sequence[str] = OPEN_METHODS) -> None:  # fmt: skip
        if not keys:
            raise SecurityConfigError("ApiKeyInterceptor needs at least one key")
        self._digests = [_key_digest(key) for key in keys]
        self._open_prefixes = tuple(f"/{service}/" for service in open_services)
        self._open_methods = frozenset(open_methods)

    def check(self, metadata: Sequence[Any] | None) -> str | None:
        """None when the metadata carries a valid key, else what the client must change."""
        header = bearer_token(metadata)
        if header is None:
            return ("missing API key: this server requires the metadata `authorization: Bearer <api key>` "
                    "(ringserve client commands: --api-key or RINGSERVE_API_KEY)")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != _BEARER or not token.strip():
            return "the authorization metadata must be `Bearer <api key>`"
        digest = _key_digest(token.strip())
        matched = False
        for known in self._digests:  # no early exit: every key is compared, whichever matches
            matched |= hmac.compare_digest(digest, known)
        return None if matched else "invalid API key"

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(self._open_prefixes) or method in self._open_methods:
            return await continuation(handler_call_details)
        problem = self.check(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:  # an unknown method stays UNIMPLEMENTED
            return handler
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, problem)


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers `code` without reading or parsing the request."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)


# -- server ---------------------------------------------------------------------------------------------------------


def add_server_security_arguments(p: argparse.ArgumentParser) -> None:
    """The serve flags for TLS, API keys and message sizes; each also reads its RINGSERVE_* variable."""

    def flag(name: str, default: object, type_: type, help_: str) -> None:
        p.add_argument(name, default=env_default(name, default, type_), type=type_, help=f"{help_} {env_help(name)}")

    flag("--tls-cert-file", "", str, "PEM certificate chain of the server; with --tls-key-file turns TLS on")
    flag("--tls-key-file", "", str, "PEM private key of --tls-cert-file")
    flag("--tls-client-ca-file", "", str,
         "PEM CA certificates for mutual TLS: clients must present a certificate signed by one of them")
    flag("--api-key", "", str,
         "require `authorization: Bearer <key>` metadata on every RPC except health, reflection, TorchServe "
         "Ping and KServe ServerLive/ServerReady; several keys comma-separated (prefer the variable or "
         "--api-key-file: flags show in `ps`)")
    flag("--api-key-file", "", str, "a file of API keys, one per line (# comments allowed); adds to --api-key")
    flag("--max-message-size-mib", DEFAULT_MAX_MESSAGE_MIB, int,
         "largest gRPC message received or sent, in MiB; a larger request gets RESOURCE_EXHAUSTED "
         "(default %(default)s)")


@dataclass(frozen=True)
class ServerSecurity:
    """How the server's port is secured; the default is plaintext without keys and 64 MiB messages."""

    certificate_chain: bytes = b""
    private_key: bytes = field(default=b"", repr=False)
    client_ca: bytes = b""  # non-empty = mutual TLS: a client certificate is required and verified
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_MIB << 20
    # The files the PEM blocks came from: the HTTP server (uvicorn, Python's ssl) loads a key pair only from files.
    certificate_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        """Read and check the files the flags name; SecurityConfigError says which flag to change."""
        cert, key, client_ca = args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file
        if bool(cert) != bool(key):
            raise SecurityConfigError("--tls-cert-file and --tls-key-file turn TLS on together: give both or neither")
        if client_ca and not cert:
            raise SecurityConfigError("--tls-client-ca-file (mutual TLS) needs TLS: add --tls-cert-file and "
                                      "--tls-key-file")
        if args.max_message_size_mib < 1:
            raise SecurityConfigError(f"--max-message-size-mib must be at least 1 (got {args.max_message_size_mib})")
        security = cls(
            certificate_chain=_read_pem(cert, "--tls-cert-file", "CERTIFICATE") if cert else b"",
            private_key=_read_pem(key, "--tls-key-file", "PRIVATE KEY") if key else b"",
            client_ca=_read_pem(client_ca, "--tls-client-ca-file", "CERTIFICATE") if client_ca else b"",
            api_keys=load_api_keys(args.api_key, args.api_key_file),
            max_message_bytes=args.max_message_size_mib << 20,
            certificate_file=cert, key_file=key, client_ca_file=client_ca,
        )
        if cert:
            _check_key_pair(cert, key, client_ca)
        return security

    @property
    def tls(self) -> bool:
        return bool(self.certificate_chain)

    @property
    def mutual_tls(self) -> bool:
        return bool(self.client_ca)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Authentication first, so an unauthenticated request is never parsed."""
        chain: list[grpc.aio.ServerInterceptor] = []
        if self.api_keys:
            chain.append(ApiKeyInterceptor(self.api_keys))
        chain.append(RequestBoundaryInterceptor())
        return chain

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)],
                                           root_certificates=self.client_ca or None,
                                           require_client_auth=self.mutual_tls)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address` with TLS when configured; the bound port (0 when binding failed)."""
        credentials = self.credentials()
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)

    def describe(self) -> str:
        """One line for the start-up log; never a key."""
        transport = "mutual TLS (client certificates required)" if self.mutual_tls else "TLS" if self.tls else \
            "plaintext"
        auth = (f"API keys required ({len(self.api_keys)} configured; health, reflection and TorchServe Ping open)"
                if self.api_keys else "no API key")
        return f"{transport}, {auth}, messages up to {self.max_message_bytes >> 20} MiB"


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityConfigError(f"{flag} {path}: cannot read it: {exc}") from None


def _check_key_pair(cert: str, key: str, client_ca: str) -> None:
    """Refuse a key that does not belong to the certificate now, with the flags named; gRPC would only fail to bind."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=b"")  # an encrypted key fails here instead of prompting
    except (OSError, ssl.SSLError) as exc:
        raise SecurityConfigError(f"--tls-cert-file {cert} / --tls-key-file {key}: not a certificate chain and its "
                                  f"unencrypted private key ({exc})") from None
    if client_ca:
        try:
            context.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"--tls-client-ca-file {client_ca}: not PEM CA certificates ({exc})") from None


def _read_pem(path: str, flag: str, kind: str) -> bytes:
    text = _read_text(path, flag)
    if "-----BEGIN " not in text or kind not in text:
        raise SecurityConfigError(f"{flag} {path}: not a PEM file with a {kind} block")
    return text.encode()


# -- client ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client dials a server: plaintext unless `tls` (implied by any of the TLS files)."""

    tls: bool = False
    ca_file: str = ""  # PEM roots that sign the server's certificate; empty = the system's roots
    cert_file: str = ""  # client certificate (mutual TLS)
    key_file: str = ""
    server_name: str = ""  # the name the server's certificate must carry; empty = the dialed host
    api_key: str = field(default="", repr=False)

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file)

    def channel_credentials(self, host: str) -> grpc.ChannelCredentials | None:
        """None for a plain insecure channel. SecurityConfigError when the settings cannot work."""
        if bool(self.cert_file) != bool(self.key_file):
            raise SecurityConfigError("--tls-client-cert-file and --tls-client-key-file go together: give both")
        if self.uses_tls:
            base = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(self.ca_file, "--tls-ca-file", "CERTIFICATE") if self.ca_file else None,
                private_key=_read_pem(self.key_file, "--tls-client-key-file", "PRIVATE KEY") if self.key_file
                else None,
                certificate_chain=_read_pem(self.cert_file, "--tls-client-cert-file", "CERTIFICATE")
                if self.cert_file else None,
            )
        elif self.api_key:
            if not is_loopback(host):
                raise SecurityConfigError(f"an API key is only sent over TLS or to a loopback address, and {host} is "
                                          "neither: add --tls (or --tls-ca-file) to reach it over TLS")
            base = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        else:
            return None
        if self.api_key:  # sent as `authorization: Bearer <key>` on every call
            return grpc.composite_channel_credentials(base, grpc.access_token_call_credentials(self.api_key))
        return base

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.uses_tls and self.server_name else []


def split_host(address: str) -> str:
    """The host part of `host:port` or `[v6]:port`."""
    if address.startswith("["):
        return address[1:address.index("]")]
    return address.rsplit(":", 1)[0]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_channel(address: str, security: ChannelSecurity | None = None) -> grpc.Channel:
    security = security or ChannelSecurity()
    credentials = security.channel_credentials(split_host(address))
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials, options=security.options())


def open_aio_channel(address: str, security: ChannelSecurity | None = None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:  # fmt: skip
    security = security or ChannelSecurity()
    credentials = security.channel_credentials(split_host(address))
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=[*security.options(), *options])


def add_channel_security_arguments(parser: argparse.ArgumentParser) -> None:
    """Client flags: TLS roots, client certificate (mutual TLS), server name, API key; each reads RINGSERVE_*."""
    parser.add_argument("--tls", action="store_true", default=env_default("TLS", False, parse_bool),
                        help=f"connect over TLS, trusting the system's CA certificates {env_help('TLS')}")
    parser.add_argument("--tls-ca-file", default=env_default("TLS_CA_FILE", ""),
                        help=f"PEM CA certificates to trust for the server's certificate; implies --tls "
                             f"{env_help('TLS_CA_FILE')}")
    parser.add_argument("--tls-client-cert-file", default=env_default("TLS_CLIENT_CERT_FILE", ""),
                        help=f"PEM client certificate for mutual TLS; implies --tls {env_help('TLS_CLIENT_CERT_FILE')}")
    parser.add_argument("--tls-client-key-file", default=env_default("TLS_CLIENT_KEY_FILE", ""),
                        help=f"PEM private key of --tls-client-cert-file {env_help('TLS_CLIENT_KEY_FILE')}")
    parser.add_argument("--tls-server-name", default=env_default("TLS_SERVER_NAME", ""),
                        help=f"the name the server's certificate must carry (default: the --host dialed) "
                             f"{env_help('TLS_SERVER_NAME')}")
    parser.add_argument("--api-key", default=env_default("API_KEY", ""),
                        help=f"API key sent as `authorization: Bearer <key>`; of a comma-separated list the first "
                             f"(only over TLS or to a loopback address) {env_help('API_KEY')}")
    parser.add_argument("--api-key-file", default=env_default("API_KEY_FILE", ""),
                        help=f"read the API key from this file (its first key) {env_help('API_KEY_FILE')}")


def channel_security_from_args(args: argparse.Namespace) -> ChannelSecurity:
    keys = load_api_keys(args.api_key, args.api_key_file)
    return ChannelSecurity(tls=args.tls, ca_file=args.tls_ca_file, cert_file=args.tls_client_cert_file,
                           key_file=args.tls_client_key_file, server_name=args.tls_server_name,
                           api_key=keys[0] if keys else "")


def probe_security(environ: Mapping[str, str]) -> ChannelSecurity:
    """What the container health probe needs to reach the server configured by `environ` (RINGSERVE_* variables).

    Client settings win (RINGSERVE_TLS_CA_FILE, RINGSERVE_TLS_CLIENT_CERT_FILE/_KEY_FILE, RINGSERVE_TLS_SERVER_NAME);
    otherwise a TLS server (RINGSERVE_TLS_CERT_FILE) is dialed trusting the server's own certificate file (right for a
    self-signed certificate or a chain that includes its root), and a mutual TLS server (RINGSERVE_TLS_CLIENT_CA_FILE)
    is shown the server's own certificate and key, which it accepts when the same CA issued both. Health needs no
    API key.
    """

    def get(name: str) -> str:
        return environ.get(f"RINGSERVE_{name}", "").strip()

    server_cert, server_key = get("TLS_CERT_FILE"), get("TLS_KEY_FILE")
    ca_file = get("TLS_CA_FILE") or server_cert
    cert_file, key_file = get("TLS_CLIENT_CERT_FILE"), get("TLS_CLIENT_KEY_FILE")
    if not cert_file and get("TLS_CLIENT_CA_FILE"):
        cert_file, key_file = server_cert, server_key
    tls = bool(ca_file or cert_file) or get("TLS").lower() in ("1", "true", "yes", "on")
    return ChannelSecurity(tls=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file,
                           server_name=get("TLS_SERVER_NAME"))
