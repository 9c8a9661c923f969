"""One process of tests/test_program_cache.py: calls a PersistentJit with its cache forced on in
``cache_dir`` for each shape asked, and writes what it did as JSON.

    persistent_jit.py CACHE_DIR OUT_JSON ROWSxCOLS [...] [--jax-cache DIR]
"""

import json
import logging
import sys

from fthsdp.devices import enable_compilation_cache, force_host_devices

force_host_devices(2)
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
args = sys.argv[1:]
if "--jax-cache" in args:  # JAX's own persistent cache as well, as a one-process job has it
    i = args.index("--jax-cache")
    enable_compilation_cache(args[i + 1])
    del args[i:i + 2]
cache_dir, out, shapes = args[0], args[1], args[2:]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fthsdp.step import program_cache as pc  # noqa: E402


def fn(x, y):
    return jnp.tanh(x @ y).sum(axis=0) * 3.0


f = pc.persistent_jit(fn, cache_dir=cache_dir)
outputs = []
for shape in shapes:
    rows, cols = (int(n) for n in shape.split("x"))
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) / 7
    y = np.ones((cols, 5), np.float32) / 3
    for _ in range(2):  # the second call goes straight to the program
        got = np.asarray(f(x, y))
    outputs.append({"shape": shape, "bytes": got.tobytes().hex(),
                    "reference": np.asarray(__import__("jax").jit(fn)(x, y)).tobytes().hex()})
with open(out, "w") as fh:
    json.dump({"loaded": f.counts.loaded, "compiled": f.counts.compiled, "programs": f._cache_size(),
               "outputs": outputs}, fh)
