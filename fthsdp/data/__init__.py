"""Deterministic byte-level data: every batch is addressed by (replica, position)."""

from fthsdp.data.corpus import generate_corpus
from fthsdp.data.stream import Batch, LoaderState, ReplicaStream, eval_batches

__all__ = ["Batch", "LoaderState", "ReplicaStream", "eval_batches", "generate_corpus"]
