"""More than eight ranks in one engine on a Ray cluster on this host (ray.cluster_utils.Cluster): a head node of
eight CPUs and a node of one, nine one-CPU bundles packed (eight on the engine's node, the head: Ray connects a
driver to the head where several nodes share its host; one on the other). The
engine's node's eight ranks and the other node's relay would be nine readers of the engine's step ring, one more
than a ring has, so the engine's node gets a relay too and every rank reads its node's ring. A tiny nine-layer
llama in nine pipeline stages decodes the tokens of one local rank. 82 s here at load 7 (nine workers and their
actors start on two cores); like test_ray_executor.py, skipped without Ray."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from server_harness import start_server

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM as HfLlamaForCausalLM
from workers_testkit import TINY, save_word_tokenizer

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ringserve[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402
from test_ray_executor import FLAGS, assert_nothing_left, greedy, local_cluster, segments  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from local_cluster(8, 1)


def save_nine_layer_llama(folder: Path) -> Path:
    torch.manual_seed(0)
    hf = HfLlamaForCausalLM(HfLlamaConfig(**{**TINY, "num_hidden_layers": 9}))
    hf.save_pretrained(folder)
    save_word_tokenizer(folder, hf.config.vocab_size)
    return folder


def test_nine_pipeline_stages_on_two_nodes_decode_like_one_rank(cluster: Cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model = save_nine_layer_llama(tmp_path / "llama-9-layers")
    with start_server(model, tmp_path, *FLAGS) as server:
        single = greedy(server, 16)
        assert server.stop() == 0
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    flags = ("--distributed-executor", "ray", "--placement-strategy", "PACK", "--pipeline-parallel-size", "9")
    with start_server(model, tmp_path, *FLAGS, *flags, ready_timeout_s=420) as server:
        workers = [" ".join(p.cmdline()) for p in psutil.Process(server.proc.pid).children(recursive=True)
                   if "ringserve.workers.worker_main" in " ".join(p.cmdline())]  # fmt: skip
        assert workers == [], "the ranks are Ray actors' children, not the engine's"
        ours = f"{sys.executable} -m ringserve.workers.worker_main"  # other checkouts' servers may run on the host
        ranks = [c for p in psutil.process_iter(["cmdline"])
                 if (c := " ".join(p.info["cmdline"] or ())).startswith(ours)]  # fmt: skip
        assert len(ranks) == 9 and all("-rstep" in c for c in ranks), ranks  # every rank reads a node relay's ring
        assert greedy(server, 16) == single
        assert server.stop() == 0
    assert_nothing_left(cluster, server.proc.pid, before)
