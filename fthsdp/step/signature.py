"""What a replica's training state is made of, as one number every replica of a job must share.

FTAR checks that a neighbour sends the number of bytes it expects, not what
they mean: replicas built from different configs whose states have the same
size (a bfloat16 model beside a float16 one, two layers swapped, another
optimizer with the same slots) would average bytes of different things, and
train on without an error. Each replica leader states its signature with every
quorum request (``QuorumRequest.state_signature``), and the lighthouse refuses
one that differs from a live replica's, naming both (fthsdp.control.lighthouse),
before any byte is exchanged.

The signature hashes the state's tree structure (the containers and their
field names), each leaf's global shape and dtype (not the values, nor the
sharding: the ring checks its own shape), and the config sections that decide
what the numbers mean without changing their shapes: ``model`` (activations'
dtype), ``optim`` (learning rate, schedule) and ``data`` (the corpus and the
batches each replica draws: exactly-once is counted over one stream), and
:data:`FIELDS` (the schedule's length, the initial parameters' seed, the
learning-rate intervention, the SDC fingerprint's settings, which change the
compiled update). With a config it also hashes the runtime that computes the
numbers (:func:`runtime`: the jax, jaxlib and fthsdp versions, the backend and
its device kind, 64-bit mode, the default matmul precision): the update's
reductions (the gradient clip's global norm) round differently across them, and
the fingerprints of honest replicas would then disagree and read as silent data
corruption. Run one version on one kind of device per job.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

SIGNATURE_BITS = 63  # a positive int64 (0 means "not stated" on the wire)


SECTIONS = ("model", "optim", "data")  # the config a job's replicas must share beyond the state's shapes
# ... and single fields elsewhere that change the numbers: the learning-rate schedule's length
# (train.steps), the initial parameters (train.seed) and the learning-rate intervention.
FIELDS = (("train", "steps"), ("train", "seed"), ("ft", "intervention"), ("ft", "fingerprint"),
          ("ft", "fingerprint_every"))


def runtime() -> list[str]:
    """What computes the numbers: replicas that differ here round the same update differently."""
    import jaxlib

    import fthsdp

    return [f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}",
            f"fthsdp={getattr(fthsdp, '__version__', '')}", f"backend={jax.default_backend()}",
            f"device_kind={jax.devices()[0].device_kind}", f"x64={bool(jax.config.jax_enable_x64)}",
            f"matmul_precision={jax.config.jax_default_matmul_precision}"]


def _field(cfg: Any, section: str, name: str) -> str:
    value = getattr(getattr(cfg, section), name)
    if (section, name) == ("ft", "intervention"):  # one mode, however it is spelt ("SQRT", "sqrt", 2)
        from fthsdp.step.intervention import Intervention

        value = Intervention.parse(value).name.lower()
    return f"{section}.{name}={value!r}"


def describe(state: Any, cfg: Any = None) -> str:
    """The text the signature hashes: the tree structure, one ``shape dtype`` per leaf, then
    the config's :data:`SECTIONS` (when given) as ``section.field=value`` lines."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    parts = [str(treedef)]
    for leaf in leaves:
        shape = tuple(int(d) for d in np.shape(leaf))
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        parts.append(f"{shape} {dtype.name}")
    for section in SECTIONS if cfg is not None else ():
        fields = dataclasses.asdict(getattr(cfg, section))
        parts += [f"{section}.{k}={fields[k]!r}" for k in sorted(fields)]
    for section, name in FIELDS if cfg is not None else ():
        parts.append(_field(cfg, section, name))
    if cfg is not None:
        parts += runtime()
    return "\n".join(parts)


def state_signature(state: Any, cfg: Any = None) -> int:
    """A 63-bit hash of :func:`describe` (never 0: 0 is "not stated")."""
    digest = hashlib.blake2b(describe(state, cfg).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % ((1 << SIGNATURE_BITS) - 1) + 1
