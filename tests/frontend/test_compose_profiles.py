"""docker/compose.yaml's deployments run commands the CLI accepts: every profile's `command` parses with the real
`ringserve` parser and passes the same checks `ringserve serve` makes, and the disaggregated profile's router points
at the prefill and decode services with the roles and KV transfer they need (no Docker engine needed: it runs
wherever the unit tests do; tests/docker/ bring the profiles up)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ringserve.frontend.cli import build_parser
from ringserve.frontend.launcher import check_serve_arguments

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def parsed(service: dict[str, Any]) -> Any:
    command = service.get("command") or ["serve"]  # the image's CMD
    return build_parser().parse_args(command)


def test_every_ringserve_service_runs_a_valid_command(services: dict[str, Any]) -> None:
    ringserve = {name: s for name, s in services.items() if s.get("image", "").startswith("ringserve:")}
    assert {"ringserve", "ringserve-prefill", "ringserve-decode", "ringserve-router"} <= ringserve.keys()
    for name, service in ringserve.items():
        args = parsed(service)
        if args.command == "serve":
            assert check_serve_arguments(args) is None, name


def test_the_disaggregated_profile_wires_router_prefill_and_decode(services: dict[str, Any]) -> None:
    disagg = {name for name, s in services.items() if "disagg" in s.get("profiles", [])}
    assert disagg == {"ringserve-prefill", "ringserve-decode", "ringserve-router"}
    prefill, decode = parsed(services["ringserve-prefill"]), parsed(services["ringserve-decode"])
    assert (prefill.role, prefill.kv_transfer) == ("prefill", "nixl")
    assert (decode.role, decode.kv_transfer) == ("decode", "nixl")
    router = parsed(services["ringserve-router"])
    assert router.command == "router" and router.host == "0.0.0.0"
    assert router.prefill == [f"ringserve-prefill:{prefill.port}"]
    assert router.decode == [f"ringserve-decode:{decode.port}"]
    # Only the router is published; the servers are reached over the compose network.
    assert services["ringserve-prefill"]["ports"] == [] and services["ringserve-decode"]["ports"] == []
    assert any(f":{router.port}" in port for port in services["ringserve-router"]["ports"])
    for name in ("ringserve-prefill", "ringserve-decode"):
        assert "tcp" in services[name]["environment"]["UCX_TLS"]  # NIXL's UCX backend needs tcp (not sm alone)


def test_published_ports_are_the_ports_the_images_serve_on(services: dict[str, Any]) -> None:
    """The images set RINGSERVE_PORT, _HTTP_PORT and _METRICS_PORT and EXPOSE them; compose publishes those container
    ports, and the observability profile's Prometheus scrapes the metrics one."""
    docker = COMPOSE.parent
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (docker / dockerfile).read_text()
        image = {name: int(port) for name, port in re.findall(r"RINGSERVE_(PORT|HTTP_PORT|METRICS_PORT)=(\d+)", text)}
        assert image.keys() == {"PORT", "HTTP_PORT", "METRICS_PORT"}, dockerfile
        assert len(set(image.values())) == 3, image
        exposed = re.search(r"^EXPOSE (.+)$", text, re.MULTILINE)
        assert exposed and sorted(map(int, exposed[1].split())) == sorted(image.values()), dockerfile
    published = sorted(int(mapping.rsplit(":", 1)[1]) for mapping in services["ringserve"]["ports"])
    assert published == sorted(image.values())
    scrape = yaml.safe_load((docker / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"][0]
    assert scrape["targets"] == [f"ringserve-observed:{image['METRICS_PORT']}"]
