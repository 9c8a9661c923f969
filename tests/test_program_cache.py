"""fthsdp/step/program_cache.py: the entry format, the key, and a PersistentJit that stores,
loads, dispatches on signature and survives a damaged entry, in one process (the cache forced on
with ``cache_dir``). The two-process case, where it is on by itself for the follower, is in
tests/test_replica_group.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fthsdp.step import program_cache as pc


def test_an_entry_round_trips_and_a_damaged_one_says_what_is_wrong():
    payload = bytes(range(256)) * 10
    raw = pc.pack_entry(payload)
    assert pc.unpack_entry(raw) == payload
    for bad, why in [(raw[:-1], "SHA-256"), (raw[:len(pc.MAGIC) + 5], "SHA-256"),
                     (raw[:-5] + b"xxxxx", "SHA-256"), (b"", "not a program entry"),
                     (b"fthsdp-program-v0\n" + raw[len(pc.MAGIC):], "not a program entry")]:
        with pytest.raises(ValueError, match=why):
            pc.unpack_entry(bad)


def test_the_key_separates_what_the_program_text_does_not_say():
    base = dict(process_index=1, process_count=2, device_ids=((2, 3),), xla_flags="--f=1", versions=("a", "b"))
    k = pc.program_key("module @m {}", **base)
    assert k == pc.program_key("module @m {}", **base) and len(k) == 64
    others = [pc.program_key("module @n {}", **base)]
    for field, value in [("process_index", 0), ("process_count", 3), ("device_ids", ((3, 2),)),
                         ("xla_flags", "--f=2"), ("versions", ("a", "c"))]:
        others.append(pc.program_key("module @m {}", **{**base, field: value}))
    assert len({k, *others}) == len(others) + 1


WORKER = pathlib.Path(__file__).parent / "cache_workers" / "persistent_jit.py"


def _process(cache_dir: pathlib.Path, out: pathlib.Path, *shapes: str, jax_cache: pathlib.Path | None = None) -> dict:
    """One new process calling a PersistentJit (JAX's own cache off unless ``jax_cache``)."""
    env = {k: v for k, v in os.environ.items() if k != "FTHSDP_COMPILATION_CACHE" and not k.startswith("JAX_")}
    cmd = [sys.executable, str(WORKER), str(cache_dir), str(out), *shapes]
    r = subprocess.run(cmd + (["--jax-cache", str(jax_cache)] if jax_cache else []), capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    res["log"] = r.stderr
    for o in res["outputs"]:  # whatever the program's origin, the same bits as jax.jit's
        assert o["bytes"] == o["reference"], o
    return res


def test_a_restarted_process_loads_what_it_stored_bit_for_bit(tmp_path):
    cache = tmp_path / "programs"
    first = _process(cache, tmp_path / "1.json", "3x4")
    assert (first["loaded"], first["compiled"], first["programs"]) == (0, 1, 1)
    (entry,) = cache.iterdir()
    assert entry.name.startswith("fn-") and pc.unpack_entry(entry.read_bytes())
    again = _process(cache, tmp_path / "2.json", "3x4", "2x4", "3x4")  # the stored shape, then a new one
    assert (again["loaded"], again["compiled"], again["programs"]) == (1, 1, 2)
    assert again["outputs"][0]["bytes"] == first["outputs"][0]["bytes"]
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_entry_is_removed_and_compiled_again_with_a_warning(tmp_path):
    cache = tmp_path / "programs"
    _process(cache, tmp_path / "1.json", "3x4")
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:-100])  # torn
    res = _process(cache, tmp_path / "2.json", "3x4")
    assert (res["loaded"], res["compiled"]) == (0, 1)
    assert "unusable" in res["log"] and "SHA-256" in res["log"] and "compiling fn again" in res["log"]
    assert pc.unpack_entry(entry.read_bytes())  # stored again, whole
    assert _process(cache, tmp_path / "3.json", "3x4")["loaded"] == 1


def test_a_program_that_came_from_jax_cache_is_not_stored_again(tmp_path):
    """XLA:CPU loses a loaded program's kernels when it is serialized again ("Function ... not
    found" at its first call), so such a program is used, not stored."""
    jax_cache = tmp_path / "jax"
    _process(tmp_path / "a", tmp_path / "1.json", "3x4", jax_cache=jax_cache)  # fills JAX's cache
    res = _process(tmp_path / "b", tmp_path / "2.json", "3x4", jax_cache=jax_cache)
    assert (res["loaded"], res["compiled"]) == (0, 1) and "came from JAX's cache" in res["log"]
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").iterdir())


def test_the_signature_tells_shapes_dtypes_weak_types_and_shardings_apart():
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    a = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("d")))
    variants = [(a,), (jax.device_put(a, NamedSharding(mesh, P(None, "d"))),), (a.astype(jnp.bfloat16),),
                (jnp.ones((2, 4)),), ((a,),), (np.ones((4, 2), np.float32),), (np.ones((4, 2)),),
                (jnp.float32(1),), (jnp.asarray(1.0),)]
    sigs = [pc._signature(v) for v in variants]
    assert len(set(sigs)) == len(sigs)
    assert pc._signature((jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("d"))),)) == sigs[0]


def test_off_in_a_one_process_runtime_and_jax_jit_there():
    f = pc.persistent_jit(lambda x: x * 2, name="<lambda>")
    f(np.ones(3, np.float32))
    assert f._dir is None and (f.counts.loaded, f.counts.compiled) == (0, 0)
    assert f._cache_size() == 1 and f.name == "_lambda_"  # jax.jit's own count; a name fit for a file
