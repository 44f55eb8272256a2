"""A small tokenised corpus, built once and read as a map-style ``Dataset`` through a
``DataLoader`` whose batch sampler is ckptd's global sample order (``ckptd.data``): which
sample a rank reads depends on the stream position and the current world, never on the dataset.

The text is a walk on a fixed sparse Markov chain over the vocabulary: every token has four
possible successors with probabilities 0.55 / 0.25 / 0.12 / 0.08, so a model can learn the
chain (the loss falls from ln(vocab) towards the chain's entropy, about 1.1 nats).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import torch
from torch.utils.data import Dataset

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


class MarkovDataset(Dataset[torch.Tensor]):
    """``samples`` rows of ``seq_len + 1`` tokens generated once from the chain: a dataset with
    a length and rows, read through a ``DataLoader`` like any other."""

    def __init__(self, vocab_size: int, seq_len: int, samples: int, seed: int = 0) -> None:
        corpus = MarkovCorpus(vocab_size, seq_len, seed)
        self.rows = torch.tensor([corpus.sample(i) for i in range(samples)], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]
