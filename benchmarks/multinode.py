"""Multi-node serving figures on one machine (docs/distributed.md).

- `step_transport_us`: a decode step's StepPlan (one entry per running request) from the engine's step ring to a
  remote node's step ring through the TCP step relay of `--distributed-executor ray` (the engine-side relay process,
  loopback TCP, the node relay), one record at a time: median and p99 in microseconds, next to the same record's trip
  through one shared-memory ring (`step_shm_us`, the local ranks' path) measured in the same run.
- `engine_node_hop_us`: what the step relay adds over the shared-memory ring for ranks on the engine's own node
  when its ring would need more than 8 readers (docs/distributed.md, "How many ranks"): that relay runs over
  loopback TCP, which is the trip `step_transport_us` measures here, so this is its median and p99 minus
  `step_shm_us`'s.
- `bridge_request_us`, `bridge_event_us` (`--engine-placement ray`): an AddRequest (64 prompt tokens) from the
  frontend's request ring to a remote engine's, and a one-token StepEvents from the remote engine's event ring to
  the frontend's, through the engine bridge (its process, loopback TCP, the EngineHost), one record at a time:
  median and p99, next to the same records' trip through one shared-memory ring (`bridge_shm_us`: a local engine's
  path).
- `tp1_tok_s`: greedy decode tokens per second of one stream on the embedded model, one rank (`ringserve serve`,
  --worker-threads 1): the baseline a pipeline-parallel figure is compared with.
- `tp3_tok_s`, `tp3_ray_tok_s` (with `--ray-address`, a cluster of at least two nodes, else null): the same with
  three ranks as local processes, then as Ray actors spread over the nodes (`--placement-strategy SPREAD`), so
  the ranks off the engine's node get every step through the relay.
- `engine_ray_tok_s`, `engine_local_tok_s` (with `--ray-address`, else null): the same one-rank replica with its
  engine and rank placed on a Ray node (`--engine-placement ray`: every request and event through the bridge), and
  with both on this host; the two servers run at once and their streams alternate, the median of 3 rounds
  (`--quick`) or 5; `engine_ray_over_local` is the ratio.
- `pp2_tok_s`: the same with two pipeline stages (--pipeline-parallel-size 2): local processes, or with
  `--ray-address` one stage per node (`--placement-strategy STRICT_SPREAD`), so the second stage gets every step
  through the relay (`pp2_ray_tok_s`; `pp2_tok_s` is then the local one).

    python benchmarks/multinode.py [--quick] [--ray-address HOST:PORT | --local-cluster]

`--local-cluster` starts a two-node Ray cluster on this host for the Ray figures (ray.cluster_utils.Cluster, two CPUs
per node, as tests/integration/test_ray_executor.py does): "remote" then means loopback TCP.

Last line: one JSON object with those keys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from live_server import live_server
from ringserve import _core
from ringserve.backend.remote_engine import EngineHost
from ringserve.backend.step_relay import TOKEN_BYTES, TOKEN_ENV, NodeRelay
from ringserve.formats.segments import new_segment_name
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc


def decode_plan(step_id: int, batch: int) -> bytes:
    slots = np.arange(batch, dtype=np.int32)
    return _core.encode_record(_core.StepPlan(
        step_id=step_id, sched_slots=slots, sched_start=slots + 100, sched_len=np.ones(batch, np.int32),
        sched_sample=np.ones(batch, bool), sched_lookahead=np.zeros(batch, np.int32)))  # fmt: skip


def percentiles(values_us: list[float]) -> dict[str, float]:
    ordered = sorted(values_us)
    return {"median": round(statistics.median(ordered), 1), "p99": round(ordered[int(0.99 * (len(ordered) - 1))], 1)}


def trips(writer: _core.RingWriter, reader: _core.RingReader, records: list[bytes]) -> list[float]:
    """Microseconds from each write to its read at the far end, one record in flight at a time."""
    out = []
    for record in records:
        start = time.perf_counter_ns()
        assert writer.write(record, 5.0)
        got = reader.read(5.0)
        out.append((time.perf_counter_ns() - start) / 1e3)
        assert got is not None and bytes(got) == record
    return out


def step_transport(count: int, batch: int) -> dict[str, object]:
    records = [decode_plan(i, batch) for i in range(count)]
    local = _core.ShmRing.create(new_segment_name("step"), 1 << 24, 1)
    try:
        shm = trips(_core.RingWriter(local), _core.RingReader(local, 0), records)
    finally:
        local.unlink()
    step = _core.ShmRing.create(new_segment_name("step"), 1 << 24, 1)
    token = secrets.token_hex(TOKEN_BYTES)
    node = NodeRelay(1, False, token)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # the node's stand-in rank
    node.watch([rank.pid])
    relay = subprocess.Popen([sys.executable, "-m", "ringserve.backend.step_relay", "--connect",
                              f"127.0.0.1:{node.port}", "--step-ring", step.name, "--step-reader", "0"],
                             env={**os.environ, TOKEN_ENV: token})  # fmt: skip
    try:
        node_reader = _core.RingReader(node.step_ring, 0)
        tcp = trips(_core.RingWriter(step), node_reader, records)
    finally:
        for proc in (relay, rank):
            proc.kill()
            proc.wait()
        node.close()
        step.unlink()
    return {
        "step_transport_us": percentiles(tcp),
        "step_shm_us": percentiles(shm),
        "step_record_bytes": len(records[0]),
        "transport_over_shm_median": round(statistics.median(tcp) / statistics.median(shm), 1),
    }


def bridge_transport(count: int) -> dict[str, object]:
    """The engine bridge's two directions, with a stand-in engine (a sleeping process the host watches)."""
    requests = [_core.encode_record(_core.AddRequest(request_id=i, prompt_token_ids=list(range(64))))
                for i in range(count)]  # fmt: skip
    events = [_core.encode_record(_core.StepEvents(step_id=i, outputs=[_core.RequestOutput(request_id=1,
              new_token_ids=[i % 1000])])) for i in range(count)]  # fmt: skip
    local = _core.ShmRing.create(new_segment_name("req"), 1 << 24, 1)
    try:
        shm = trips(_core.RingWriter(local), _core.RingReader(local, 0), requests + events)
    finally:
        local.unlink()
    request_ring = _core.ShmRing.create(new_segment_name("req"), 1 << 24, 1)
    event_ring = _core.ShmRing.create(new_segment_name("evt"), 1 << 24, 1)
    token = secrets.token_hex(TOKEN_BYTES)
    host = EngineHost(token)
    host.start(["-c", "import time; time.sleep(3600)"], {})
    bridge = subprocess.Popen([sys.executable, "-m", "ringserve.backend.remote_engine", "--connect",
                               f"127.0.0.1:{host.port}", "--request-ring", request_ring.name, "--event-ring",
                               event_ring.name], env={**os.environ, TOKEN_ENV: token})  # fmt: skip
    try:
        out = trips(_core.RingWriter(request_ring), _core.RingReader(host.request_ring, 0), requests)
        back = trips(_core.RingWriter(host.event_ring), _core.RingReader(event_ring, 0), events)
    finally:
        bridge.kill()
        bridge.wait()
        host.close(engine_stop_s=0.0)
        request_ring.unlink()
        event_ring.unlink()
    return {"bridge_request_us": percentiles(out), "bridge_event_us": percentiles(back),
            "bridge_shm_us": percentiles(shm)}  # fmt: skip


def decode_tokens_per_s(tokens: int, *flags: str) -> float:
    """Greedy decode tokens/s of one stream on the embedded model served with `flags`."""
    return alternating_tokens_per_s(tokens, 1, flags)[0]


def alternating_tokens_per_s(tokens: int, rounds: int, *configs: tuple[str, ...],
                             same_session: bool = False) -> list[float]:  # fmt: skip
    """The median over `rounds` of one stream's decode tokens/s on each of several servers (the embedded model, one
    per flag set in `configs`), all up at once and measured in turn, round after round, so load that changes during
    the run falls on each alike. `same_session`: the servers share this process's scheduler autogroup with the Ray
    cluster it started, so a Ray-placed engine's processes and a local one's get the same share of a busy CPU
    (live_server.running_process)."""
    from ringserve.frontend.model_source import embedded_model_path

    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        model = embedded_model_path()
        servers = [stack.enter_context(live_server(model, Path(logs), "--worker-threads", "1", *flags,
                                                   same_session=same_session)) for flags in configs]  # fmt: skip
        for server in servers:
            server.wait_serving(600)
        rates: list[list[float]] = [[] for _ in configs]
        for _ in range(rounds):
            for server, rate in zip(servers, rates, strict=True):
                rate.append(stream_tokens_per_s(server.address, tokens))
    return [round(statistics.median(rate), 2) for rate in rates]


def stream_tokens_per_s(address: str, tokens: int) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            text="Once upon a time", sampling=pb.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        )
        list(stub.Generate(pb.GenerateRequest(text="warm up", sampling=pb.SamplingParams(max_tokens=4)),
                           timeout=300))  # fmt: skip
        stream = stub.Generate(request, timeout=600)
        next(stream)  # from the first token on: decode only
        start = time.perf_counter()
        count = sum(len(r.token_ids) for r in stream)
        return count / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer records and tokens (a smoke run)")
    p.add_argument("--batch", type=int, default=64, help="requests in the decode step sent (default %(default)s)")
    p.add_argument("--ray-address", default="", help="also measure TP=3 local and over this Ray cluster's nodes")
    p.add_argument("--local-cluster", action="store_true", help="start a two-node Ray cluster on this host for that")
    args = p.parse_args(argv)
    if args.local_cluster:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            return measure(args, cluster.address)
        finally:
            cluster.shutdown()
    return measure(args, args.ray_address)


def measure(args: argparse.Namespace, ray_address: str) -> int:
    records, tokens, rounds = (300, 32, 3) if args.quick else (3000, 128, 5)
    result: dict[str, object] = {"quick": args.quick, "load": os.getloadavg()[0], "records": records}
    result |= step_transport(records, args.batch)
    step, shm = result["step_transport_us"], result["step_shm_us"]
    assert isinstance(step, dict) and isinstance(shm, dict)
    result["engine_node_hop_us"] = {k: round(step[k] - shm[k], 1) for k in ("median", "p99")}
    result |= bridge_transport(records)
    result["tp1_tok_s"] = decode_tokens_per_s(tokens)
    if ray_address:  # the embedded model's 9 heads split 3 ways; SPREAD puts the ranks on 2+ nodes
        os.environ["RAY_ADDRESS"] = ray_address
        tp3 = ("--tensor-parallel-size", "3")
        result["tp3_tok_s"] = decode_tokens_per_s(tokens, *tp3)
        result["tp3_ray_tok_s"] = decode_tokens_per_s(tokens, *tp3, "--distributed-executor", "ray",
                                                      "--placement-strategy", "SPREAD")  # fmt: skip
        placement = ("--distributed-executor", "ray", "--engine-placement", "ray")
        local, placed = alternating_tokens_per_s(tokens, rounds, (), placement, same_session=True)
        result |= {"engine_local_tok_s": local, "engine_ray_tok_s": placed,
                   "engine_ray_over_local": round(placed / local, 3)}  # fmt: skip
    else:
        result["tp3_tok_s"] = result["tp3_ray_tok_s"] = result["engine_ray_tok_s"] = None
        result["engine_local_tok_s"] = result["engine_ray_over_local"] = None
    pp2 = ("--pipeline-parallel-size", "2")
    result["pp2_tok_s"] = decode_tokens_per_s(tokens, *pp2)
    result["pp2_ray_tok_s"] = decode_tokens_per_s(tokens, *pp2, "--distributed-executor", "ray",
                                                  "--placement-strategy", "STRICT_SPREAD") if ray_address else None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
