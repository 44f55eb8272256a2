"""A deterministic synthetic corpus: sample ``i`` is the same token sequence on every rank, in
every world size and every run, so the data position is just the number of consumed samples.

The text is a walk on a fixed sparse Markov chain over the vocabulary: every token has four
possible successors with probabilities 0.55 / 0.25 / 0.12 / 0.08, so a model can learn the
chain (the loss falls from ln(vocab) towards the chain's entropy, about 1.1 nats).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import torch

PROBS = (0.55, 0.25, 0.12, 0.08)


class MarkovCorpus:
    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        rng = random.Random(seed)
        self.successors = [rng.sample(range(vocab_size), len(PROBS)) for _ in range(vocab_size)]
        cumulative, total = [], 0.0
        for p in PROBS:
            total += p
            cumulative.append(total)
        self.cumulative = cumulative

    def sample(self, index: int) -> list[int]:
        """``seq_len + 1`` tokens (inputs and shifted targets) of sample ``index``."""
        rng = random.Random(self.seed * 1_000_003 + index)
        token = rng.randrange(self.vocab_size)
        out = [token]
        for _ in range(self.seq_len):
            u = rng.random()
            k = next(i for i, c in enumerate(self.cumulative) if u < c or i == len(PROBS) - 1)
            token = self.successors[token][k]
            out.append(token)
        return out

    def batch(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, ``(len(indices), seq_len)`` each."""
        rows = torch.tensor([self.sample(i) for i in indices], dtype=torch.long)
        return rows[:, :-1], rows[:, 1:]
