"""Health probe for containers: exits 0 only when the server's `grpc.health.v1` service answers SERVING.

The Docker images run it as their HEALTHCHECK (`python -m ringserve.frontend.healthcheck`). It finds the server the
same way `ringserve serve` was configured (RINGSERVE_HOST, RINGSERVE_PORT); a wildcard listen address such as 0.0.0.0
is probed on loopback. With TLS on (RINGSERVE_TLS_CERT_FILE, and RINGSERVE_TLS_CLIENT_CA_FILE for mutual TLS) it
dials over TLS as `security.probe_security` describes; health needs no API key. Exit codes follow Docker's
HEALTHCHECK convention: 0 healthy, 1 unhealthy (never 2, which Docker reserves).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.formats.cli_env import env_default, env_help
from ringserve.frontend.api.security import ChannelSecurity, SecurityConfigError, open_channel, probe_security

HEALTHY = 0
UNHEALTHY = 1

# A server listening on every interface is reachable on loopback from inside its own container.
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def probe_address(host: str, port: int) -> str:
    """The address to dial for a server that listens on `host`:`port`."""
    if host in _WILDCARD_HOSTS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check_health(address: str, service: str = "", timeout_s: float = 3.0,
                 security: ChannelSecurity | None = None) -> tuple[bool, str]:  # fmt: skip
    """(serving, what was observed) for one Health.Check call; every failure is reported, none raised."""
    try:
        channel = open_channel(address, security)
    except SecurityConfigError as exc:
        return False, f"{address}: {exc}"
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
            details = error.details() if hasattr(error, "details") else str(error)
            return False, f"{address}: health check failed: {code.name}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ringserve.frontend.healthcheck",
        description="Exit 0 when the RingServe server reports SERVING on grpc.health.v1, else 1.",
    )
    parser.add_argument("--host", default=env_default("HOST", "127.0.0.1"),
                        help=f"the server's listen address; wildcards are probed on loopback {env_help('HOST')}")
    parser.add_argument("--port", type=int, default=env_default("PORT", 50051, int),
                        help=f"the server's gRPC port (default 50051) {env_help('PORT')}")
    parser.add_argument("--service", default="", help="health service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ValueError as exc:  # a RINGSERVE_* variable that does not parse
        print(f"healthcheck: {exc}", file=sys.stderr)
        return UNHEALTHY
    except SystemExit as exc:  # argparse: --help exits 0, a usage error exits 2, which Docker reserves
        return HEALTHY if exc.code in (0, None) else UNHEALTHY
    serving, observed = check_health(probe_address(args.host, args.port), args.service, args.timeout,
                                     probe_security(os.environ))
    print(observed)
    return HEALTHY if serving else UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
