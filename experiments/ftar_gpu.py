"""FTAR on the GPU: bus bandwidth beside Gloo on CUDA tensors, the CPU FTAR and
the staging ceilings, and the cost of FTAR inside the real training step.

    python experiments/ftar_gpu.py [--quick] --out results/ftar_gpu.json
    python experiments/ftar_gpu.py --table results/ftar_gpu.json   # the table again

On one GPU host, in one run, with 2 and 4 processes sharing the GPU and
64 / 256 MiB of float32 (--quick: 2 processes, 64 MiB, fewer iterations):
  ftar_gpu    FTAR through the jitted custom call on the GPU (host-staged:
              the stream copies blocks to pinned memory, the control thread
              runs the ring over loopback TCP, a 2-block reduce worker on the
              GPU sums each received chunk, the stream copies back)
  ftar_cpu    the same custom call on the CPU device of the same processes
  gloo_cuda   torch.distributed + Gloo all-reducing CUDA tensors
  loopback    TCP ceiling with n concurrent senders (experiments/peers/loopback.py)
  pinned      pinned D2H / H2D copy bandwidth (torch), the staging ceiling
and the step time of one replica's training step with FTAR (a ring of 2
replica processes sharing the GPU) against the same step with a local
identity all-reduce (same process count). A system that cannot run here
(no GPU, no torch) is recorded under `skipped`, never a crash. Rows: system,
n, bytes, busbw_gbps (median), busbw_gbps_best, times_s. `targets` evaluates
the issue's targets (GPU FTAR >= 1.5x Gloo on CUDA tensors and >= 0.8x CPU
FTAR at >= 64 MiB; step with FTAR <= 1.3x the identity step). A PNG plot is
written beside the JSON, and the table (bus bandwidth per system, process
count and size; the staging ceilings; step times; targets) is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
PEERS = HERE / "peers"
sys.path.insert(0, str(HERE))
from ftar_bandwidth import loopback, run_group  # noqa: E402

MIB = 1 << 20


def gpu_env(n: int) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cuda,cpu"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(0.75, 0.85 / max(1, n)):.3f}"
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    return env


def probe(python: str, code: str, env: dict) -> str | None:
    """None if `code` runs under `python`, else why not."""
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def busbw(n: int, nbytes: int, seconds: float) -> float:
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def measure(system: str, n: int, sizes: list[int], args, work: pathlib.Path) -> list[dict]:
    rdv = pathlib.Path(tempfile.mkdtemp(dir=work, prefix=f"{system}-{n}-"))
    out = rdv / "result.json"
    base = dict(n=n, sizes=sizes, iters=args.iters, warmup=args.warmup, rdv=str(rdv), out=str(out))
    if system in ("ftar_gpu", "ftar_cpu"):
        platform = "gpu" if system == "ftar_gpu" else "cpu"
        cmds = [[sys.executable, str(PEERS / "ftar_gpu_peer.py"),
                 json.dumps(dict(base, rank=r, platform=platform, streams=args.streams,
                                 chunk_bytes=args.chunk_bytes, chunks=args.chunks))] for r in range(n)]
    elif system == "gloo_cuda":
        cmds = [[args.torch_python, str(PEERS / "gloo_cuda_peer.py"), json.dumps(dict(base, rank=r))]
                for r in range(n)]
    else:
        raise ValueError(system)
    run_group(cmds, args.group_timeout, env=gpu_env(n))
    times = json.loads(out.read_text())["times"]
    rows = []
    for nbytes in sizes:
        ts = times[str(nbytes)]
        rows.append(dict(system=system, n=n, bytes=nbytes, times_s=ts,
                         busbw_gbps=busbw(n, nbytes, statistics.median(ts)),
                         busbw_gbps_best=busbw(n, nbytes, min(ts))))
    return rows


def pinned(sizes: list[int], args, work: pathlib.Path) -> dict:
    out = pathlib.Path(tempfile.mkdtemp(dir=work, prefix="pinned-")) / "result.json"
    run_group([[args.torch_python, str(PEERS / "pinned_copy.py"),
                json.dumps(dict(sizes=sizes, iters=args.iters, warmup=args.warmup, out=str(out)))]],
              args.group_timeout, env=gpu_env(1))
    return json.loads(out.read_text())


def step_time(mode: str, n: int, args, work: pathlib.Path, platform: str = "gpu") -> dict:
    rdv = pathlib.Path(tempfile.mkdtemp(dir=work, prefix=f"step-{mode}-"))
    out = rdv / "result.json"
    base = dict(n=n, iters=args.step_iters, warmup=3, rdv=str(rdv), out=str(out), platform=platform,
                allreduce=mode, config="base", overrides=args.step_overrides)
    cmds = [[sys.executable, str(PEERS / "step_peer.py"), json.dumps(dict(base, rank=r))] for r in range(n)]
    run_group(cmds, args.group_timeout, env=gpu_env(n))
    res = json.loads(out.read_text())
    ts = res["times"]["step"]
    return dict(mode=mode, n=n, platform=platform, median_s=statistics.median(ts), best_s=min(ts),
                times_s=ts, params=res.get("params"))


def targets(result: dict) -> dict:
    def best(system, n, nbytes):
        rows = [r for r in result["rows"] if r["system"] == system and r["n"] == n and r["bytes"] == nbytes]
        return rows[0]["busbw_gbps"] if rows else None

    out = {}
    for n in sorted({r["n"] for r in result["rows"]}):
        for nbytes in sorted({r["bytes"] for r in result["rows"] if r["bytes"] >= 64 * MIB}):
            g, c, gl = best("ftar_gpu", n, nbytes), best("ftar_cpu", n, nbytes), best("gloo_cuda", n, nbytes)
            key = f"n{n}_{nbytes // MIB}MiB"
            out[key] = {
                "gpu_ftar_vs_gloo_cuda": (g / gl) if g and gl else None,
                "gpu_ftar_vs_gloo_cuda_met": (g / gl >= 1.5) if g and gl else None,
                "gpu_ftar_vs_cpu_ftar": (g / c) if g and c else None,
                "gpu_ftar_vs_cpu_ftar_met": (g / c >= 0.8) if g and c else None,
            }
    steps = {s["mode"]: s for s in result.get("step", [])}
    if "ftar" in steps and "local" in steps:
        ratio = steps["ftar"]["median_s"] / steps["local"]["median_s"]
        out["step_ftar_vs_identity"] = {"ratio": ratio, "met": ratio <= 1.3}
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["n"] for r in result["rows"]}) or [2]
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for system in sorted({r["system"] for r in result["rows"]}):
            rows = sorted((r for r in result["rows"] if r["system"] == system and r["n"] == n),
                          key=lambda r: r["bytes"])
            if rows:
                ax.plot([r["bytes"] / MIB for r in rows], [r["busbw_gbps"] for r in rows], "o-", label=system)
        lb = result.get("loopback_gbps", {}).get(str(n))
        if lb:
            ax.axhline(lb, ls="--", c="gray", label="loopback TCP")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message (MiB, float32)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{n} processes sharing one GPU")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def table(result: dict) -> str:
    """The issue's table as text: what a person reads first."""
    lines = [f"{'system':<11} {'n':>2} {'MiB':>5} {'busbw GB/s':>11} {'best':>7}"]
    for r in sorted(result.get("rows", []), key=lambda r: (r["n"], r["bytes"], r["system"])):
        lines.append(f"{r['system']:<11} {r['n']:>2} {r['bytes'] // MIB:>5} {r['busbw_gbps']:>11.2f} "
                     f"{r['busbw_gbps_best']:>7.2f}")
    for n, gbps in sorted(result.get("loopback_gbps", {}).items()):
        lines.append(f"{'loopback':<11} {n:>2} {'':>5} {gbps:>11.2f}")
    for name in ("d2h_gbps", "h2d_gbps"):
        for nbytes, gbps in sorted(result.get("pinned", {}).get(name, {}).items(), key=lambda kv: int(kv[0])):
            lines.append(f"{'pinned ' + name[:3]:<11} {'':>2} {int(nbytes) // MIB:>5} {gbps:>11.2f}")
    for st in result.get("step", []):
        lines.append(f"step {st['mode']:<6} n={st['n']} on {st['platform']}: median {st['median_s'] * 1e3:.2f} ms, "
                     f"best {st['best_s'] * 1e3:.2f} ms")
    lines.append("targets:")
    for key, val in sorted(result.get("targets", {}).items()):
        lines.append(f"  {key}: " + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in val.items()))
    for key, why in sorted(result.get("skipped", {}).items()):
        lines.append(f"skipped {key}: {str(why)[-200:]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--table"]:
        if len(argv) != 2:
            print("usage: ftar_gpu.py --table RESULT.json", file=sys.stderr)
            return 2
        print(table(json.loads(pathlib.Path(argv[1]).read_text())))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="2 processes, 64 MiB, few iterations")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--torch-python", default=sys.executable, help="a Python with torch (CUDA)")
    p.add_argument("--group-timeout", type=float, default=900.0)
    p.add_argument("--step-iters", type=int, default=None)
    p.add_argument("--step-overrides", nargs="*", default=[], help="config overrides for the step-time model")
    p.add_argument("--step-platform", default="gpu", help="gpu (the benchmark); cpu only smoke-tests the script")
    args = p.parse_args(argv)
    ns = [2] if args.quick else [2, 4]
    sizes = [64 * MIB] if args.quick else [64 * MIB, 256 * MIB]
    args.iters = args.iters or (3 if args.quick else 8)
    args.step_iters = args.step_iters or (10 if args.quick else 40)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": {"ns": ns, "sizes": sizes, "iters": args.iters, "streams": args.streams,
                               "chunk_bytes": args.chunk_bytes, "chunks": args.chunks, "quick": args.quick},
                    "rows": [], "skipped": {}, "loopback_gbps": {}, "step": []}
    why_no_gpu = probe(sys.executable, "import jax; assert jax.devices('gpu')", gpu_env(1))
    why_no_torch = probe(args.torch_python, "import torch; assert torch.cuda.is_available()", gpu_env(1))
    # The CPU FTAR runs on any host (it is the reference the GPU path must reach).
    systems = {"ftar_gpu": why_no_gpu, "ftar_cpu": None, "gloo_cuda": why_no_torch}
    with tempfile.TemporaryDirectory(prefix="ftar-gpu-") as tmp:
        work = pathlib.Path(tmp)
        for n in ns:
            for system, why in systems.items():
                if why:
                    result["skipped"][system] = why
                    continue
                try:
                    result["rows"] += measure(system, n, sizes, args, work)
                except RuntimeError as e:
                    result["skipped"][f"{system}_n{n}"] = str(e)[-1000:]
            try:
                result["loopback_gbps"][str(n)] = loopback(n, max(sizes), work, args.group_timeout)
            except RuntimeError as e:
                result["skipped"][f"loopback_n{n}"] = str(e)[-1000:]
        if why_no_torch:
            result["skipped"]["pinned"] = why_no_torch
        else:
            try:
                result["pinned"] = pinned(sizes, args, work)
            except RuntimeError as e:
                result["skipped"]["pinned"] = str(e)[-1000:]
        if why_no_gpu and args.step_platform == "gpu":
            result["skipped"]["step"] = why_no_gpu
        else:
            for mode in ("local", "ftar"):
                try:
                    result["step"].append(step_time(mode, 2, args, work, args.step_platform))
                except RuntimeError as e:
                    result["skipped"][f"step_{mode}"] = str(e)[-1000:]
    result["targets"] = targets(result)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
