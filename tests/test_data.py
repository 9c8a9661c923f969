import numpy as np

from fthsdp.config import DataConfig
from fthsdp.data import LoaderState, ReplicaStream, eval_batches, generate_corpus

CFG = DataConfig(seq_len=16, batch_size=4, corpus_bytes=1 << 16)


def test_corpus_is_deterministic_text():
    a, b = generate_corpus(3, 1 << 14), generate_corpus(3, 1 << 14)
    assert a.tobytes() == b.tobytes() and a.size == 1 << 14
    assert generate_corpus(4, 1 << 14).tobytes() != a.tobytes()
    assert a.max() < 128  # ascii


def test_batches_are_addressed_by_replica_and_position():
    s0, s0b, s1 = ReplicaStream(CFG, 0), ReplicaStream(CFG, 0), ReplicaStream(CFG, 1)
    b = s0.batch(5)
    assert (b.replica, b.position) == (0, 5)
    assert b.inputs.shape == (4, 16) and b.inputs.dtype == np.int32
    np.testing.assert_array_equal(b.inputs, s0b.batch(5).inputs)  # rebuildable anywhere
    np.testing.assert_array_equal(b.inputs[:, 1:], b.targets[:, :-1])  # next-byte targets
    assert not np.array_equal(b.inputs, s0.batch(6).inputs)
    assert not np.array_equal(b.inputs, s1.batch(5).inputs)  # each replica its own stream


def test_loader_state_and_heldout():
    st = LoaderState(replica=2)
    assert st.advanced().advanced() == LoaderState(2, 2)
    ev = eval_batches(CFG)
    assert len(ev) == CFG.eval_batches and ev[0][0].shape == (4, 16)


def test_bad_positions_are_refused():
    import pytest

    with pytest.raises(ValueError, match="position must be >= 0"):
        ReplicaStream(CFG, 0).batch(-1)
    with pytest.raises(ValueError, match="replica id must be >= 0"):
        ReplicaStream(CFG, -1)
