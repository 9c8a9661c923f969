"""fthsdp's lighthouse now and at an earlier commit, side by side in one run.

    python experiments/before_after.py --baseline 497bcb3 --replicas 1024 --pairs 3 \\
        --out results/flat_before_after.json
    python experiments/before_after.py --baseline c1bd4e7 --shape 512x196 --rounds 100 --pairs 3 \\
        --out results/before_after_512x196.json

For each pair, one row of experiments/scale.py's ``fthsdp_row`` is measured with the
baseline commit's code and one with this tree's (flat: ``--replicas`` N directly
connected replicas of one rank each; ``--shape RxG``: R replica leaders of G emulated
ranks each, heartbeating every 0.1 s, the lighthouse untraced), in alternating order
(baseline first in even pairs), each in its own Python process, so both meet the same
load on a shared machine. The baseline's ``fthsdp`` and ``experiments`` are extracted with ``git archive`` into a
temporary folder and put first on the path of its process and of the processes it starts
(the editable install's import redirect is switched off there only). It uses the
generated gRPC stubs of this build: a newer lighthouse.proto only adds fields, which an
older side never sets and ignores.

Reports per side the p50/p99 of every pair and the ratios of the medians (baseline /
now): ratios measured side by side, not two absolute times from different hours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_SITECUSTOMIZE = '''\
# Written by experiments/before_after.py: import fthsdp from this folder (a baseline
# commit), not from the editable install of the working tree.
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
'''

_ROW = '''\
import json, sys
sys.path.insert(0, {experiments!r})
import fthsdp, scale
row = scale.fthsdp_row({system!r}, {n}, {g}, {rounds}, heartbeat_s={heartbeat})
row["fthsdp_from"] = "baseline extract" if "fthsdp-baseline-" in fthsdp.__file__ else "working tree"
print("ROW " + json.dumps({{k: row.get(k) for k in ("p50_s", "p99_s", "complete_rounds", "rounds", "loadavg",
                                                   "violations", "wall_s", "fthsdp_from")}}))
'''


def commit_name(rev: str = "HEAD") -> str:
    """``rev``'s short hash (``rev`` itself where git cannot say), and for HEAD " with
    uncommitted changes" when tracked files differ from it: what a study's "now" ran."""
    name = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True,
                          text=True).stdout.strip() or rev
    if rev == "HEAD" and subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True).stdout.strip():
        name += " with uncommitted changes"
    return name


def sides(baseline: str, into: Path) -> list[tuple[str, str]]:
    """The arms of a study run against a baseline commit: ("now", "") and, when ``baseline`` is
    given, ("baseline", ``into``) with that commit extracted there (:func:`extract`)."""
    if not baseline:
        return [("now", "")]
    extract(baseline, into)
    return [("now", ""), ("baseline", str(into))]


def extract(commit: str, into: Path) -> None:
    """The baseline's fthsdp and experiments, and this build's generated stubs beside them."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "fthsdp", "experiments"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    from fthsdp.proto import lighthouse

    pb2, _ = lighthouse()
    stubs = Path(pb2.__file__).parent
    for f in stubs.glob("lighthouse_pb2*.py"):
        shutil.copy(f, into / "fthsdp" / "proto" / f.name)
    (into / "sitecustomize.py").write_text(_SITECUSTOMIZE)


_CALL = '''\
import json, sys
import fthsdp
assert {root!r} == "" or fthsdp.__file__.startswith({root!r}), fthsdp.__file__
sys.path.insert(0, {experiments!r})
import {module} as m
print("RESULT " + json.dumps(m.{fn}(*{args!r})))
'''


def call_with(root: Path | str | None, module: str, fn: str, *args, timeout_s: float = 600.0):
    """``experiments/<module>.py``'s ``fn(*args)`` (this tree's function; its result JSON-able)
    in a Python process of its own whose fthsdp is the extract at ``root``'s (None: this
    tree's), and so is that of every process it starts: a change on the clients' side
    measured against an earlier commit's clients, servers and all."""
    from fthsdp.sim.emulation import package_first

    env = dict(os.environ) if root is None else package_first(str(root))
    code = _CALL.format(root=str(root or ""), experiments=str(REPO / "experiments"), module=module, fn=fn, args=args)
    with tempfile.TemporaryDirectory(prefix="fthsdp-before-after-") as cwd:
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout_s)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{module}.{fn} failed with {'the baseline' if root else 'this tree'} "
                           f"(exit {r.returncode}): {r.stderr.strip()[-1500:]}")
    return json.loads(line[len("RESULT "):])


def measure(side: str, root: Path | None, shape: tuple[int, int], rounds: int, timeout_s: float) -> dict:
    """One row in its own process: ``root`` the baseline's extract (None: this tree); ``shape``
    (R, G): R leaders of G ranks, or R flat replicas when G is 0."""
    from fthsdp.sim.emulation import package_first

    env = dict(os.environ) if root is None else package_first(root)
    experiments = str((root or REPO) / "experiments")
    n, g = shape
    code = _ROW.format(experiments=experiments, system="fthsdp-flat" if g == 0 else "fthsdp-hierarchical", n=n,
                       g=max(1, g), rounds=rounds, heartbeat=0.0 if g == 0 else 0.1)
    # a folder of its own: nothing of the tree on the path by accident
    with tempfile.TemporaryDirectory(prefix="fthsdp-before-after-") as cwd:
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout_s)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        return {"side": side, "error": f"exit {r.returncode}: {r.stderr.strip()[-400:]}"}
    return {"side": side, **json.loads(line[4:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--replicas", type=int, default=1024, help="flat rows: directly connected replicas")
    ap.add_argument("--shape", default="", metavar="RxG",
                    help="hierarchical rows instead: R replica leaders x G ranks each (e.g. 512x196)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per row")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="per row (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.shape:
        r, _, g = args.shape.lower().partition("x")
        if not (r.isdigit() and g.isdigit() and int(r) > 0 and int(g) > 0):
            ap.error(f"--shape takes RxG (replica leaders x ranks per replica, e.g. 512x196), got {args.shape!r}")
        shape = (int(r), int(g))
    else:
        shape = (args.replicas, 0)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline], check=True,
                            capture_output=True, text=True).stdout.strip()
    now = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fthsdp-baseline-") as d:
        base = Path(d)
        extract(args.baseline, base)
        for i in range(args.pairs):
            order = [("baseline", base), ("now", None)] if i % 2 == 0 else [("now", None), ("baseline", base)]
            for side, root in order:
                r = measure(side, root, shape, args.rounds, args.timeout)
                r["pair"] = i
                rows.append(r)
                p50, p99 = r.get("p50_s"), r.get("p99_s")
                print(f"pair {i} {side:8s}: p50 {'-' if p50 is None else f'{p50 * 1e3:.1f} ms'} "
                      f"p99 {'-' if p99 is None else f'{p99 * 1e3:.1f} ms'} "
                      f"({r.get('complete_rounds', 0)}/{r.get('rounds', args.rounds)} rounds, "
                      f"load {r.get('loadavg', [0])[0]:.1f}){' ' + r['error'] if 'error' in r else ''}", flush=True)

    def med(side: str, key: str) -> float | None:
        xs = [r[key] for r in rows if r["side"] == side and r.get(key)]
        return statistics.median(xs) if xs else None

    def pair_ratios(key: str) -> list[float]:
        out = []
        for i in range(args.pairs):
            pb, pn = (next((r.get(key) for r in rows if r["pair"] == i and r["side"] == side), None)
                      for side in ("baseline", "now"))
            if pb and pn:
                out.append(pb / pn)
        return out

    keys = ("p50_s", "p99_s")
    medians = {key: {side: med(side, key) for side in ("baseline", "now")} for key in keys}
    out = {"experiment": "before_after", "baseline_commit": commit, "now_commit": now,
           "shape": {"replicas": shape[0], "ranks_per_replica": shape[1] or 1, "flat": shape[1] == 0},
           "replicas": shape[0], "rounds_per_row": args.rounds, "pairs": args.pairs, "rows": rows,
           "median_p50_s": medians["p50_s"], "median_p99_s": medians["p99_s"],
           "ratio_of_medians_baseline_over_now": {
               key: medians[key]["baseline"] / medians[key]["now"] if medians[key]["baseline"] and medians[key]["now"]
               else None for key in keys},
           "pair_ratios_baseline_over_now": {key: pair_ratios(key) for key in keys},
           "definition": "p50/p99 of a round: last request to every rank holding the answer (scale.py)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("median_p50_s", "median_p99_s", "ratio_of_medians_baseline_over_now")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
