"""Per-replica batch streams addressed by (replica, position).

Batch (r, p) is a pure function of the data config, r and p: any process can
rebuild any batch, so a retried step trains the same bytes, a catching-up
replica can skip positions without reading them, and the exactly-once ledger
can name every batch that went into the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fthsdp.config import DataConfig
from fthsdp.data.corpus import generate_corpus

_EVAL_SEED_OFFSET = 1_000_003  # held-out text comes from a different corpus


@dataclass(frozen=True)
class Batch:
    replica: int
    position: int
    inputs: np.ndarray  # (batch, seq) int32
    targets: np.ndarray  # (batch, seq) int32


@dataclass(frozen=True)
class LoaderState:
    """Where a replica's stream stands: the next position to train."""

    replica: int
    position: int = 0

    def advanced(self) -> "LoaderState":
        return LoaderState(self.replica, self.position + 1)


def _windows(corpus: np.ndarray, rng: np.random.Generator, batch: int, seq: int):
    starts = rng.integers(0, corpus.size - seq - 1, size=batch)
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    tokens = corpus[idx].astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


class ReplicaStream:
    """The training stream of one replica."""

    def __init__(self, cfg: DataConfig, replica: int):
        if replica < 0:
            raise ValueError(f"replica id must be >= 0, got {replica}")
        self.cfg = cfg
        self.replica = replica
        self.corpus = generate_corpus(cfg.seed, cfg.corpus_bytes)

    def batch(self, position: int) -> Batch:
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        rng = np.random.default_rng(np.random.PCG64([self.cfg.seed, self.replica, position]))
        x, y = _windows(self.corpus, rng, self.cfg.batch_size, self.cfg.seq_len)
        return Batch(self.replica, position, x, y)


def eval_batches(cfg: DataConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed held-out batches (from a corpus the training streams never read)."""
    corpus = generate_corpus(cfg.seed + _EVAL_SEED_OFFSET, max(cfg.corpus_bytes // 8, 1 << 16))
    out = []
    for i in range(cfg.eval_batches):
        rng = np.random.default_rng(np.random.PCG64([cfg.seed, 0xE7A1, i]))
        out.append(_windows(corpus, rng, cfg.batch_size, cfg.seq_len))
    return out
