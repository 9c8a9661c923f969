"""Where the replicas of a local job run on a GPU host (pure: no GPU needed)."""

from __future__ import annotations

import pytest

from fthsdp.devices import PLACED_ENV, GpuPlacement, gpu_placement, launcher_gpu_env, place_replica_on_gpus


def test_no_gpus_changes_nothing():
    assert gpu_placement(0, 3, 1, []) == GpuPlacement(None, None)


def test_enough_gpus_give_each_replica_its_own():
    gpus = [str(i) for i in range(8)]
    got = [gpu_placement(r, 4, 2, gpus).visible for r in range(4)]
    assert got == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert all(gpu_placement(r, 4, 2, gpus).mem_fraction is None for r in range(4))


@pytest.mark.parametrize("replicas,share", [(2, 0.45), (3, 0.3), (4, 0.225)])
def test_replicas_sharing_one_gpu_split_its_memory(replicas, share):
    for r in range(replicas):
        p = gpu_placement(r, replicas, 1, ["0"])
        assert p.visible == ("0",) and p.mem_fraction == pytest.approx(share)
        assert p.mem_fraction * replicas <= 0.9


def test_round_robin_when_replicas_outnumber_gpus():
    gpus = ["0", "1"]
    assert [gpu_placement(r, 3, 1, gpus).visible for r in range(3)] == [("0",), ("1",), ("0",)]
    assert gpu_placement(0, 3, 1, gpus).mem_fraction == pytest.approx(0.45)


def test_more_devices_per_replica_than_gpus_is_left_to_the_mesh_error():
    assert gpu_placement(0, 2, 4, ["0", "1"]) == GpuPlacement(None, None)


def test_user_settings_win(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    p = place_replica_on_gpus(1, 2, 1)
    assert p.visible == ("3",)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2"


def test_cpu_only_platform_sees_no_gpus(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert place_replica_on_gpus(0, 2, 1) == GpuPlacement(None, None)


def test_the_launcher_splits_its_own_visible_gpus_among_every_process(monkeypatch):
    """A CUDA_VISIBLE_DEVICES the launcher inherited (a Slurm allocation) is the pool it splits:
    passed on unchanged it read as each replica's own choice, and every replica stacked on its
    first GPUs. Replica r's process p is slot r*P+p."""
    pool = ["4", "5", "6", "7"]
    env = [launcher_gpu_env(r, 2, 1, p, 2, pool, {}) for r in range(2) for p in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["4", "5", "6", "7"]
    assert all(e[PLACED_ENV] == "1" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in e for e in env)
    shared = launcher_gpu_env(2, 3, 2, gpus=pool, environ={})  # 3 replicas x 2 GPUs on 4: they share
    assert shared["CUDA_VISIBLE_DEVICES"] == "4,5" and float(shared["XLA_PYTHON_CLIENT_MEM_FRACTION"]) < 0.75
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in launcher_gpu_env(
        2, 3, 2, gpus=pool, environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"})  # the user's wins
    assert launcher_gpu_env(0, 2, 1, gpus=[], environ={}) == {}  # no GPUs: nothing
    # a process the launcher placed keeps what it was given
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    monkeypatch.setenv(PLACED_ENV, "1")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert place_replica_on_gpus(1, 2, 1) == GpuPlacement(None, None)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
