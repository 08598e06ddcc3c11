"""Batch sampler: temperature, top-k, top-p and per-request seeds over a [rows, vocab] logits tensor.

Logprobs are the chosen token's log-softmax under the RAW model logits (before temperature, top-k and
top-p), which is what vLLM returns by default; they describe the model, not the sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GREEDY_TEMPERATURE = 1e-5  # at or below this, sampling is argmax


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, aligned with the logits rows."""

    temperature: torch.Tensor  # float32 [rows]; 0 = greedy
    top_k: torch.Tensor  # int64 [rows]; 0 = off
    top_p: torch.Tensor  # float32 [rows]; 1 = off
    generators: list[torch.Generator | None]  # a seeded request's own generator, or None for the shared one

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        generators: list[torch.Generator | None],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            generators=generators,
        )


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows draw from this one generator; seeded rows never touch it, so their streams stay reproducible.
        self.generator = generator if generator is not None else torch.Generator()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token ids int64 [rows], logprobs float32 [rows])."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        sampled_rows = batch.temperature > _GREEDY_TEMPERATURE
        if bool(sampled_rows.any()):
            rows = sampled_rows.nonzero().squeeze(1)
            tokens[rows] = self._sample(
                logits[rows],
                batch.temperature[rows],
                batch.top_k[rows],
                batch.top_p[rows],
                [batch.generators[i] for i in rows.tolist()],
            )
        return tokens, raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        scaled = logits / temperature.unsqueeze(1)
        # Work in descending order: top-k is a prefix, top-p a prefix of the cumulative mass.
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always survives.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        choice = self._draw(probs, generators)
        return order.gather(1, choice.unsqueeze(1)).squeeze(1)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exponential race (argmax p / E, E ~ Exp(1)): one draw per row, each row from its own generator."""
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            noise[shared] = torch.empty((len(shared), probs.shape[1]), device=probs.device).exponential_(
                generator=self.generator
            )
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # A zero draw would turn a zero-probability token into 0/0 = NaN.
        return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)
