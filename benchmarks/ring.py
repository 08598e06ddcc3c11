"""Shared-memory rings against ZeroMQ ipc:// + msgpack (vLLM v1's API-server <-> engine-core transport), measured in
the same run, every figure between two OS processes.

    python benchmarks/ring.py [--quick]

Two measurements per transport:
- round trip: a 200-byte record is sent, the peer process echoes it, the reply is received; median and p99 in us.
- one way: 1 KiB records streamed to the peer as fast as it takes them; records/s and MB/s (10^6 bytes of record
  payload per s) counted by the receiver from its first record to its last.

Three transports:
- ring (the issue's keys `rtt_us_median`, `rtt_us_p99`, `records_per_s_1k`, `mb_per_s_1k`): our RingWriter/RingReader
  driven by native loops in each process (`_core.bench_ring_*`), as the C++ engine drives its rings. Records are
  copied into and out of the ring and their sequence numbers checked.
- ring through the Python binding (keys ending `_python`): the same rings from Python loops (`RingWriter.write`,
  `RingReader.read`), i.e. the cost a Python frontend or worker pays, call overhead included.
- zmq (keys starting `zmq_`): pyzmq PUSH/PULL sockets over ipc://; every record is msgpack-encoded
  `[sequence number, payload]` and decoded by the receiver (the echo decodes and re-encodes), as vLLM does.
`rtt_ratio_vs_zmq` = zmq median / ring median (`rtt_ratio_vs_zmq_python` for the binding), `records_ratio_vs_zmq` =
ring records/s / zmq records/s. Targets (issue #4): rtt_ratio_vs_zmq >= 10, records_per_s_1k >= 2,000,000.

Processes are started with subprocess; only ring names and socket addresses cross on argv. Each side is pinned to its
own CPU when the machine has two or more (--no-pin to let the scheduler place them). Every measurement runs --rounds
times (2 with --quick, 3 without) and each transport reports its best round (lowest median round trip, with that
round's p99; highest records/s): the same rule for all three, which keeps a busy shared machine from deciding the
comparison. The last line of output is one JSON object; `loadavg_1m` records how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq
from ringserve import _core
from tqdm import tqdm

RTT_RECORD_BYTES = 200
STREAM_RECORD_BYTES = 1024
PEER_TIMEOUT_S = 30.0
RTT_RING_BYTES = 1 << 16
STREAM_RING_BYTES = 1 << 22  # 4 MiB, the result ring's production size: rides out the peer being descheduled


@dataclass(frozen=True)
class Counts:
    rtt_native: int
    rtt_python: int
    rtt_zmq: int
    stream_native: int
    stream_python: int
    stream_zmq: int

    @staticmethod
    def for_run(quick: bool) -> Counts:
        if quick:
            return Counts(20_000, 20_000, 5_000, 2_000_000, 300_000, 100_000)
        return Counts(200_000, 100_000, 20_000, 10_000_000, 1_000_000, 500_000)


def warmup_of(count: int) -> int:
    return count // 10


def payload(size: int) -> bytes:
    return bytes((i * 131 + 7) % 256 for i in range(size))


def seq_of(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "little")


# ---- peer processes (the other end of every measurement) ------------------------------------------------------------


def pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def peer_ring_echo(req: str, res: str, count: int) -> dict[str, Any]:
    echoed = _core.bench_ring_echo(_core.ShmRing.attach(req), _core.ShmRing.attach(res), count, PEER_TIMEOUT_S)
    return {"echoed": echoed}


def peer_ring_consume(name: str, count: int) -> dict[str, Any]:
    return dict(_core.bench_ring_consume(_core.ShmRing.attach(name), count, PEER_TIMEOUT_S))


def peer_python_echo(req: str, res: str, count: int) -> dict[str, Any]:
    reader = _core.RingReader(_core.ShmRing.attach(req))
    writer = _core.RingWriter(_core.ShmRing.attach(res))
    for _ in range(count):
        raw = reader.read(PEER_TIMEOUT_S)
        if raw is None or not writer.write(raw, PEER_TIMEOUT_S):
            raise SystemExit("python echo: the ping side went away")
    return {"echoed": count}


def peer_python_consume(name: str, count: int) -> dict[str, Any]:
    reader = _core.RingReader(_core.ShmRing.attach(name))
    first = 0
    total = 0
    for seq in range(count):
        raw = reader.read(PEER_TIMEOUT_S)
        if raw is None:
            raise SystemExit("python consume: the producer went away")
        if seq == 0:
            first = time.perf_counter_ns()
        if seq_of(raw) != seq:
            raise SystemExit(f"python consume: record {seq_of(raw)} arrived where {seq} was due")
        total += len(raw)
    return {"records": count, "bytes": total, "elapsed_ns": time.perf_counter_ns() - first}


def peer_zmq_echo(req: str, res: str, count: int) -> dict[str, Any]:
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(req)
    outbox.connect(res)
    for _ in range(count):
        outbox.send(msgpack.packb(msgpack.unpackb(inbox.recv())))
    outbox.close(linger=1000)
    inbox.close()
    ctx.term()
    return {"echoed": count}


def peer_zmq_consume(address: str, count: int) -> dict[str, Any]:
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(address)
    first = 0
    total = 0
    for expected in range(count):
        seq, data = msgpack.unpackb(inbox.recv())
        if expected == 0:
            first = time.perf_counter_ns()
        if seq != expected:
            raise SystemExit(f"zmq consume: record {seq} arrived where {expected} was due")
        total += 8 + len(data)
    inbox.close()
    ctx.term()
    return {"records": count, "bytes": total, "elapsed_ns": time.perf_counter_ns() - first}


PEERS: dict[str, Callable[..., dict[str, Any]]] = {
    "ring-echo": peer_ring_echo,
    "ring-consume": peer_ring_consume,
    "python-echo": peer_python_echo,
    "python-consume": peer_python_consume,
    "zmq-echo": peer_zmq_echo,
    "zmq-consume": peer_zmq_consume,
}


def run_peer(argv: list[str]) -> None:
    """`ring.py --peer ROLE CPU ARGS... COUNT`: prints its result as JSON."""
    role, cpu, *rest = argv
    pin(None if cpu == "-" else int(cpu))
    *names, count = rest
    print(json.dumps(PEERS[role](*names, int(count))), flush=True)


# ---- the measuring side ---------------------------------------------------------------------------------------------


@dataclass
class Peer:
    proc: subprocess.Popen[str]

    def result(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=PEER_TIMEOUT_S * 2)
        if self.proc.returncode != 0:
            raise RuntimeError(f"peer exited with {self.proc.returncode}: {err.strip()}")
        return dict(json.loads(out.strip().splitlines()[-1]))


def start_peer(role: str, cpu: int | None, *args: object) -> Peer:
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", role, "-" if cpu is None else str(cpu)]
    return Peer(subprocess.Popen([*cmd, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


@contextmanager
def rings(*capacities: int) -> Iterator[list[_core.ShmRing]]:
    made = [_core.ShmRing.create(f"/ringserve-{os.getpid()}-{secrets.token_hex(8)}-bench", c) for c in capacities]
    try:
        yield made
    finally:
        for ring in made:
            ring.unlink()


def rtt_summary(rtt_ns: np.ndarray | list[int], warmup: int) -> tuple[float, float]:
    timed = np.asarray(rtt_ns, dtype=np.float64)[warmup:] / 1e3
    return float(np.median(timed)), float(np.percentile(timed, 99))


def stream_summary(result: dict[str, Any]) -> tuple[float, float]:
    seconds = result["elapsed_ns"] / 1e9
    intervals = result["records"] - 1  # timed from the first record to the last
    per_s = intervals / seconds
    return per_s, per_s * STREAM_RECORD_BYTES / 1e6


def rtt_ring_native(count: int, cpu: int | None) -> tuple[float, float]:
    with rings(RTT_RING_BYTES, RTT_RING_BYTES) as (req, res):
        peer = start_peer("ring-echo", cpu, req.name, res.name, count)
        rtt = _core.bench_ring_ping(req, res, RTT_RECORD_BYTES, count, PEER_TIMEOUT_S)
        peer.result()
    return rtt_summary(rtt, warmup_of(count))


def rtt_ring_python(count: int, cpu: int | None) -> tuple[float, float]:
    with rings(RTT_RING_BYTES, RTT_RING_BYTES) as (req, res):
        peer = start_peer("python-echo", cpu, req.name, res.name, count)
        writer, reader = _core.RingWriter(req), _core.RingReader(res)
        tail = payload(RTT_RECORD_BYTES - 8)
        rtt = []
        clock = time.perf_counter_ns
        for seq in range(count):
            out = seq.to_bytes(8, "little") + tail
            start = clock()
            writer.write(out, PEER_TIMEOUT_S)
            reply = reader.read(PEER_TIMEOUT_S)
            rtt.append(clock() - start)
            if reply != out:
                raise RuntimeError("python ring: wrong echo")
        peer.result()
    return rtt_summary(rtt, warmup_of(count))


def rtt_zmq(count: int, cpu: int | None, folder: str) -> tuple[float, float]:
    ctx = zmq.Context()
    outbox, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    req, res = f"ipc://{folder}/rtt-req", f"ipc://{folder}/rtt-res"
    outbox.bind(req)
    inbox.bind(res)
    peer = start_peer("zmq-echo", cpu, req, res, count)
    tail = payload(RTT_RECORD_BYTES - 8)
    rtt = []
    clock = time.perf_counter_ns
    for seq in range(count):
        start = clock()
        outbox.send(msgpack.packb([seq, tail]))
        got, _data = msgpack.unpackb(inbox.recv())
        rtt.append(clock() - start)
        if got != seq:
            raise RuntimeError("zmq: wrong echo")
    peer.result()
    outbox.close()
    inbox.close()
    ctx.term()
    return rtt_summary(rtt, warmup_of(count))


def stream_ring_native(count: int, cpu: int | None) -> tuple[float, float]:
    with rings(STREAM_RING_BYTES) as (ring,):
        peer = start_peer("ring-consume", cpu, ring.name, count)
        _core.bench_ring_produce(ring, STREAM_RECORD_BYTES, count, PEER_TIMEOUT_S)
        return stream_summary(peer.result())


def stream_ring_python(count: int, cpu: int | None) -> tuple[float, float]:
    with rings(STREAM_RING_BYTES) as (ring,):
        peer = start_peer("python-consume", cpu, ring.name, count)
        writer = _core.RingWriter(ring)
        tail = payload(STREAM_RECORD_BYTES - 8)
        write = writer.write
        for seq in range(count):
            if not write(seq.to_bytes(8, "little") + tail, PEER_TIMEOUT_S):
                raise RuntimeError("python ring: the consumer went away")
        return stream_summary(peer.result())


def stream_zmq(count: int, cpu: int | None, folder: str) -> tuple[float, float]:
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PUSH)
    address = f"ipc://{folder}/stream"
    outbox.bind(address)
    peer = start_peer("zmq-consume", cpu, address, count)
    tail = payload(STREAM_RECORD_BYTES - 8)
    send, pack = outbox.send, msgpack.packb
    for seq in range(count):
        send(pack([seq, tail]))
    result = peer.result()
    outbox.close()
    ctx.term()
    return stream_summary(result)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        run_peer(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records per measurement (< 60 s)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the two processes to separate CPUs")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per measurement (default 2 quick, 3 full)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    counts = Counts.for_run(args.quick)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) >= 2
    peer_cpu = cpus[1] if pinned else None
    if pinned:
        os.sched_setaffinity(0, {cpus[0]})

    with tempfile.TemporaryDirectory(prefix="ringserve-bench-") as folder:
        steps: list[tuple[str, str, Callable[[], tuple[float, float]]]] = [
            ("rtt", "ring round trip", lambda: rtt_ring_native(counts.rtt_native, peer_cpu)),
            ("rtt_python", "ring (Python) round trip", lambda: rtt_ring_python(counts.rtt_python, peer_cpu)),
            ("rtt_zmq", "zmq round trip", lambda: rtt_zmq(counts.rtt_zmq, peer_cpu, folder)),
            ("stream", "ring 1 KiB stream", lambda: stream_ring_native(counts.stream_native, peer_cpu)),
            ("stream_python", "ring (Python) 1 KiB stream", lambda: stream_ring_python(counts.stream_python, peer_cpu)),
            ("stream_zmq", "zmq 1 KiB stream", lambda: stream_zmq(counts.stream_zmq, peer_cpu, folder)),
        ]
        figures: dict[str, tuple[float, float]] = {}
        with tqdm(total=len(steps) * rounds, unit="measurement", file=sys.stderr) as progress:
            for key, label, measure in steps:
                progress.set_description(label)
                results = []
                for _ in range(rounds):
                    results.append(measure())
                    progress.update()
                # round trips: the lowest median; streams: the most records/s (first element either way)
                figures[key] = min(results) if key.startswith("rtt") else max(results)
                unit = ("us median", "us p99") if key.startswith("rtt") else ("records/s", "MB/s")
                progress.write(f"{label:28s} {figures[key][0]:14,.2f} {unit[0]:10s} {figures[key][1]:14,.2f} {unit[1]}")

    rtt, rtt_py, rtt_z = figures["rtt"], figures["rtt_python"], figures["rtt_zmq"]
    rec, rec_py, rec_z = figures["stream"], figures["stream_python"], figures["stream_zmq"]
    result = {
        "benchmark": "ring",
        "rtt_us_median": round(rtt[0], 3),
        "rtt_us_p99": round(rtt[1], 3),
        "records_per_s_1k": round(rec[0]),
        "mb_per_s_1k": round(rec[1], 1),
        "zmq_rtt_us_median": round(rtt_z[0], 3),
        "zmq_rtt_us_p99": round(rtt_z[1], 3),
        "zmq_records_per_s_1k": round(rec_z[0]),
        "zmq_mb_per_s_1k": round(rec_z[1], 1),
        "rtt_ratio_vs_zmq": round(rtt_z[0] / rtt[0], 1),
        "records_ratio_vs_zmq": round(rec[0] / rec_z[0], 1),
        "rtt_us_median_python": round(rtt_py[0], 3),
        "rtt_us_p99_python": round(rtt_py[1], 3),
        "records_per_s_1k_python": round(rec_py[0]),
        "mb_per_s_1k_python": round(rec_py[1], 1),
        "rtt_ratio_vs_zmq_python": round(rtt_z[0] / rtt_py[0], 1),
        "targets_met": {"rtt_10x_lower_than_zmq": rtt_z[0] / rtt[0] >= 10, "records_per_s_1k_2m": rec[0] >= 2e6},
        "measured": {
            "ring": "native RingWriter/RingReader loops in two processes (_core.bench_ring_*)",
            "ring_python": "the same rings through the Python binding, Python loops in two processes",
            "zmq": "pyzmq PUSH/PULL over ipc://, msgpack [seq, payload] encoded and decoded per record",
        },
        "rtt_record_bytes": RTT_RECORD_BYTES,
        "stream_record_bytes": STREAM_RECORD_BYTES,
        "stream_ring_capacity_bytes": STREAM_RING_BYTES,
        "round_trips": {"ring": counts.rtt_native, "ring_python": counts.rtt_python, "zmq": counts.rtt_zmq},
        "stream_records": {"ring": counts.stream_native, "ring_python": counts.stream_python, "zmq": counts.stream_zmq},
        "warmup_fraction": 0.1,
        "rounds": rounds,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "pinned_cpus": pinned,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
