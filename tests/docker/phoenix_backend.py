"""Arize Phoenix as the Docker tests' OTLP trace backend: a real one (OTLP/gRPC receiver, SQLite store, REST query
API), run on the host from the virtual environment `scripts/docker-env.sh phoenix` makes, so that a server container
exports to it as it would to Jaeger and the test reads the stored spans back through Phoenix's own API."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from docker_harness import free_port

START_TIMEOUT_S = 300  # its first start creates the database (migrations) on a loaded two-core machine


@dataclass
class Phoenix:
    http_port: int  # the UI and the REST API (also OTLP/HTTP at /v1/traces)
    grpc_port: int  # OTLP/gRPC, where the servers export
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def wait_ready(self) -> None:
        """Until the REST API answers (the OTLP receiver starts with it)."""
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            exited = self.process.poll()
            assert exited is None, f"phoenix serve exited with {exited}\n{self.log_tail()}"
            try:
                self.get("/v1/projects")
                return
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"Phoenix not up in {START_TIMEOUT_S}s\n{self.log_tail()}"
                time.sleep(1)

    def get(self, path: str, **params: str | int) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}{query}", timeout=30) as reply:
            return json.loads(reply.read())

    def spans(self, project: str, trace_id: str) -> list[dict]:
        """The spans Phoenix stored for one trace of a project ([] while the project does not exist yet)."""
        try:
            return self.get(f"/v1/projects/{urllib.parse.quote(project)}/spans", trace_id=trace_id, limit=1000)["data"]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return []
            raise

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def phoenix_backend(venv: Path, workdir: Path) -> Iterator[Phoenix]:
    """`phoenix serve` started on free ports, listening on every interface (containers reach it as
    host.docker.internal), its database in `workdir`; not waited for (`wait_ready`: it takes tens of seconds, which
    the caller can overlap); stopped (SIGTERM, then SIGKILL) when the block ends."""
    phoenix = Phoenix(http_port=free_port(), grpc_port=free_port(), log=workdir / "phoenix.log")
    env = {**os.environ, "PHOENIX_HOST": "0.0.0.0", "PHOENIX_PORT": str(phoenix.http_port),
           "PHOENIX_GRPC_PORT": str(phoenix.grpc_port), "PHOENIX_WORKING_DIR": str(workdir),
           "PHOENIX_TELEMETRY_ENABLED": "false"}  # fmt: skip
    with phoenix.log.open("wb") as log:
        process = subprocess.Popen([str(venv / "bin" / "phoenix"), "serve"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    phoenix.process = process
    try:
        yield phoenix
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
