"""Batch sampler: greedy, top-k, top-p, per-request seeds, raw-logit logprobs, and the sampled distribution."""

from __future__ import annotations

import torch
from ringserve.workers.sampler import Sampler, SamplingBatch


def batch(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generators=None) -> SamplingBatch:
    return SamplingBatch.build([temperature] * rows, [top_k] * rows, [top_p] * rows, generators or [None] * rows)


def random_logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax_with_raw_logprobs():
    logits = random_logits()
    tokens, logprobs = Sampler()(logits, batch(4, temperature=0.0))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = random_logits(rows=8)
    sampler = Sampler(torch.Generator().manual_seed(5))
    for _ in range(20):
        tokens, _ = sampler(logits, batch(8, temperature=5.0, top_k=1))
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_logprobs_are_of_the_raw_logits_not_the_tempered_distribution():
    logits = random_logits(rows=2)
    tokens, logprobs = Sampler(torch.Generator().manual_seed(1))(logits, batch(2, temperature=3.0, top_k=5))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_seeded_rows_are_reproducible_and_independent_of_the_rest_of_the_batch():
    logits = random_logits(rows=3, vocab=1000)

    def draws(seed: int, neighbours_seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        sampler = Sampler(torch.Generator().manual_seed(neighbours_seed))
        out = []
        for _ in range(10):
            tokens, _ = sampler(logits, batch(3, temperature=1.5, generators=[None, gen, None]))
            out.append(int(tokens[1]))
        return out

    assert draws(seed=42, neighbours_seed=0) == draws(seed=42, neighbours_seed=99)
    assert draws(seed=42, neighbours_seed=0) != draws(seed=43, neighbours_seed=0)


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(rows=4, vocab=100)
    temps = SamplingBatch.build([0.0, 2.0, 0.0, 2.0], [0] * 4, [1.0] * 4, [None] * 4)
    sampler = Sampler(torch.Generator().manual_seed(3))
    seen_row1 = set()
    for _ in range(30):
        tokens, _ = sampler(logits, temps)
        assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[2]) == int(logits[2].argmax())
        seen_row1.add(int(tokens[1]))
    assert len(seen_row1) > 1


def test_top_p_only_samples_from_the_smallest_set_reaching_p():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two (0.5 < 0.75 <= 0.8).
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(2000, 1)
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, batch(2000, top_p=0.75))
    assert set(tokens.tolist()) == {1, 3}
    # Renormalised 0.5 / 0.8 = 0.625 for token 1 (binomial sd ~ 0.011).
    assert abs((tokens == 1).float().mean().item() - 0.625) < 0.06


def test_top_k_only_samples_from_the_k_most_likely():
    logits = random_logits(rows=1, vocab=30).repeat(3000, 1)
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, batch(3000, temperature=2.0, top_k=3))
    assert set(tokens.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(tokens.tolist())) == 3


def test_sampled_frequencies_match_the_softmax_at_temperature():
    torch.manual_seed(0)
    logits = torch.randn(1, 8).repeat(20000, 1)
    temperature = 0.7
    tokens, _ = Sampler(torch.Generator().manual_seed(11))(logits, batch(20000, temperature=temperature))
    observed = torch.bincount(tokens, minlength=8).float() / 20000
    expected = torch.softmax(logits[0] / temperature, -1)
    # 20000 draws: each frequency's sd <= 0.0036; allow ~5 sd.
    assert (observed - expected).abs().max().item() < 0.02
