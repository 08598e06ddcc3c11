"""One huge request cannot freeze the server: a prompt longer than the context length can hold is refused before it
is tokenized (INVALID_ARGUMENT naming the field, on ringserve.v1 and TorchServe alike), and the largest prompt the
size bound lets through is tokenized in a thread with the interpreter lock released, so running streams keep their
pace meanwhile. Paces are compared as ratios within one run, never against a fixed time."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from ringserve.frontend.text.tokenizer import load_tokenizer
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, compile_torchserve_stubs, start_server

CLIENT_DIR = Path(__file__).parent / "torchserve_client"
TEN_MIB = 10 << 20
# Ordinary English, repeated: about 4 bytes a token, so a prompt at the size bound has several times the context
# length in tokens and is refused once tokenized.
PROSE = ("The harbour town woke before the sun. Fishing boats slid out past the breakwater one after another, their "
         "lamps swinging, while the bakers on the hill pulled the first loaves from the ovens.\n")


@pytest.fixture(scope="module")
def huge_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(model_path, tmp_path_factory.mktemp("huge"), "--worker-threads", "1",
                       "--num-kv-blocks", "256", "--max-num-batched-tokens", "256")  # fmt: skip
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"


@pytest.fixture(scope="module")
def size_bound(huge_server: RunningServer, model_path: Path) -> int:
    """The server's prompt size bound, computed as the server does: (context length - 1) x max bytes per token."""
    info = huge_server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=30)
    per_token = load_tokenizer(model_path).max_bytes_per_token
    assert info.context_length > 1 and per_token > 0
    return (info.context_length - 1) * per_token


def refusal(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()  # type: ignore[operator]
    return refused.value


def test_a_10_mib_prompt_is_refused_before_tokenizing_naming_the_field(huge_server: RunningServer,
                                                                        size_bound: int) -> None:
    frontend = psutil.Process(huge_server.proc.pid)
    rss_before = frontend.memory_info().rss
    text = "a" * TEN_MIB  # one token covers at most a few "a"s: millions of tokens, were it tokenized
    sent = time.monotonic()
    error = refusal(lambda: list(huge_server.stub().Generate(pb.GenerateRequest(text=text), timeout=120)))
    print(f"\n[huge prompt] a 10 MiB prompt refused {time.monotonic() - sent:.2f} s after it was sent")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("text:") and f"more than {size_bound} bytes" in error.details()
    conversation = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text[: TEN_MIB // 2]),
                                             pb.ChatMessage(role="user", content=text[: TEN_MIB // 2])])
    error = refusal(lambda: list(huge_server.stub().Generate(pb.GenerateRequest(messages=conversation), timeout=120)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("messages:"), error
    error = refusal(lambda: huge_server.stub().Tokenize(pb.TokenizeRequest(text=text), timeout=120))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("text:"), error
    first = frontend.memory_info().rss - rss_before
    # The frontend held the messages (the received bytes, gRPC's buffers, the parsed message, the text as a str),
    # never a tokenization of them (that took 880 MiB for one 10 MiB prompt), and it lets go of each when its call
    # ends: ten more refusals cost less than the ten messages themselves (holding them took 33 MiB each).
    warm = frontend.memory_info().rss
    for _ in range(10):
        error = refusal(lambda: list(huge_server.stub().Generate(pb.GenerateRequest(text=text), timeout=120)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    more = frontend.memory_info().rss - warm
    print(f"[huge prompt] frontend RSS: +{first / 2**20:.1f} MiB after the first three 10 MiB refusals, "
          f"{more / 2**20:+.1f} MiB after ten more")
    assert first < 3 * 5 * TEN_MIB, f"the frontend grew by {first / 2**20:.0f} MiB"
    assert more < 10 * TEN_MIB, f"the frontend grew by {more / 2**20:.0f} MiB over ten more refusals"
    # One byte over the bound is refused without tokenizing, one byte under it is tokenized (and then refused for
    # its token count): the two refusals say different things.
    over = refusal(lambda: list(huge_server.stub().Generate(pb.GenerateRequest(text="a" * (size_bound + 1)),
                                                            timeout=120)))
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in over.details(), over


def test_torchserve_predictions_get_the_same_refusal(huge_server: RunningServer, size_bound: int,
                                                     tmp_path: Path) -> None:
    stubs = compile_torchserve_stubs(CLIENT_DIR, tmp_path)
    model = huge_server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=30).model
    # TorchServe's messages must not share a descriptor pool with ringserve's: a separate client process.
    client = f"""
import json, sys
sys.path.insert(0, {str(stubs)!r})
import grpc, inference_pb2, inference_pb2_grpc
body = json.dumps({{"prompt": "a" * {TEN_MIB}, "max_new_tokens": 4}}).encode()
with grpc.insecure_channel({huge_server.address!r}) as channel:
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    try:
        stub.Predictions(inference_pb2.PredictionsRequest(model_name={model!r}, input={{"data": body}}), timeout=120)
        print(json.dumps({{"code": "OK"}}))
    except grpc.RpcError as error:
        print(json.dumps({{"code": error.code().name, "details": error.details()}}))
"""
    run = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["code"] == "INVALID_ARGUMENT", answer
    assert answer["details"].startswith("text:") and f"more than {size_bound} bytes" in answer["details"], answer


class PacedStream:
    """A long greedy stream read in a thread, recording when each message with tokens arrived."""

    def __init__(self, server: RunningServer) -> None:
        request = pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(
            max_tokens=4000, temperature=0.0, ignore_eos=True))
        self.call = server.stub().Generate(request, timeout=600)
        self.arrivals: list[float] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                if response.token_ids:
                    self.arrivals.append(time.monotonic())
        except grpc.RpcError as error:  # cancelled at the end of the test
            self.error = error

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive messages whose interval overlaps [start, end]."""
        times = list(self.arrivals)
        return [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]


def test_streams_keep_their_pace_while_the_largest_allowed_prompt_is_tokenized(huge_server: RunningServer,
                                                                                size_bound: int) -> None:
    streams = [PacedStream(huge_server) for _ in range(2)]
    took: list[float] = []
    try:
        while min(len(s.arrivals) for s in streams) < 10:  # past the prefill
            assert all(s.thread.is_alive() for s in streams), [s.error for s in streams]
            time.sleep(0.05)
        warm = time.monotonic()
        largest = (PROSE * (size_bound // len(PROSE) + 1))[:size_bound]
        assert len(largest.encode()) == size_bound
        # The largest prompt, sent again and again for a few seconds: every request is tokenized in full, then refused.
        started = time.monotonic()
        while not took or time.monotonic() - started < 4.0:
            sent = time.monotonic()
            error = refusal(lambda: list(huge_server.stub().Generate(pb.GenerateRequest(text=largest), timeout=300)))
            took.append(time.monotonic() - sent)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert "tokens but the context length is" in error.details(), error.details()  # it was tokenized
        ended = time.monotonic()
        time.sleep(max(ended - started, 3.0))  # the same pace without the huge requests, as long again
        after = time.monotonic()
        baseline = [g for s in streams for g in s.gaps(warm, started) + s.gaps(ended + 0.5, after)]
        during = [g for s in streams for g in s.gaps(started, ended)]
    finally:
        for s in streams:
            s.call.cancel()
            s.thread.join(timeout=30)
    assert len(baseline) >= 10 and len(during) >= 4, (baseline, during)
    base_median, base_max = statistics.median(baseline), max(baseline)
    during_median, during_max = statistics.median(during), max(during)
    shortest = min(took)
    print(f"\n[huge prompt] {size_bound} bytes tokenized and refused {len(took)} times in {shortest:.2f}-"
          f"{max(took):.2f} s; inter-token gaps: baseline median {base_median * 1e3:.0f} ms max "
          f"{base_max * 1e3:.0f} ms ({len(baseline)}), during median {during_median * 1e3:.0f} ms max "
          f"{during_max * 1e3:.0f} ms ({len(during)})")
    # An event loop frozen while a request is tokenized shows a gap at least as long as that request took; the test
    # can tell one only if a request takes clearly longer than the streams' slowest ordinary gap.
    assert shortest > 2 * base_max, "the tokenization was too quick to show anything on this machine"
    assert during_max < 0.75 * shortest, f"a stream stalled for {during_max:.2f} s of a request's {shortest:.2f} s"
    assert during_median < 3 * base_median, (during_median, base_median)
