"""The flat lighthouse now and at an earlier commit, side by side in one run.

    python experiments/flat_before_after.py --baseline 497bcb3 --replicas 1024 --pairs 3 \\
        --out results/flat_before_after.json

For each pair, one flat row (experiments/scale.py's ``fthsdp_row``: N directly connected
replicas, the emulation with one rank each, the real lighthouse process) is measured with
the baseline commit's code and one with this tree's, in alternating order (baseline first
in even pairs), each in its own Python process, so both meet the same load on a shared
machine. The baseline's ``fthsdp`` and ``experiments`` are extracted with ``git archive``
into a temporary folder and put first on the path of its process and of the lighthouse it
starts (the editable install's import redirect is switched off there only). It uses the
generated gRPC stubs of this build: a newer lighthouse.proto only adds fields, which an
older side never sets and ignores.

Reports per side the p50/p99 of every pair and the ratio of the medians (baseline /
now): a ratio measured side by side, not two absolute times from different hours.
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
# Written by experiments/flat_before_after.py: import fthsdp from this folder (a baseline
# commit), not from the editable install of the working tree.
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
'''

_ROW = '''\
import json, sys
sys.path.insert(0, {experiments!r})
import fthsdp, scale
row = scale.fthsdp_row("fthsdp-flat", {n}, 1, {rounds}, heartbeat_s=0.0)
row["fthsdp_from"] = "baseline extract" if "fthsdp-baseline-" in fthsdp.__file__ else "working tree"
print("ROW " + json.dumps({{k: row.get(k) for k in ("p50_s", "p99_s", "complete_rounds", "rounds", "loadavg",
                                                   "violations", "wall_s", "fthsdp_from")}}))
'''


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


def measure(side: str, root: Path | None, n: int, rounds: int, timeout_s: float) -> dict:
    env = dict(os.environ)
    experiments = str((root or REPO) / "experiments")
    if root is not None:
        env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = _ROW.format(experiments=experiments, n=n, rounds=rounds)
    with tempfile.TemporaryDirectory(prefix="fthsdp-flat-ba-") as cwd:  # nothing of the tree on the path by accident
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout_s)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        return {"side": side, "error": f"exit {r.returncode}: {r.stderr.strip()[-400:]}"}
    return {"side": side, **json.loads(line[4:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--replicas", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per row")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="per row (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
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
                r = measure(side, root, args.replicas, args.rounds, args.timeout)
                r["pair"] = i
                rows.append(r)
                p50 = r.get("p50_s")
                print(f"pair {i} {side:8s}: p50 {'-' if p50 is None else f'{p50 * 1e3:.0f} ms'} "
                      f"({r.get('complete_rounds', 0)}/{r.get('rounds', args.rounds)} rounds, "
                      f"load {r.get('loadavg', [0])[0]:.1f}){' ' + r['error'] if 'error' in r else ''}", flush=True)

    def med(side: str) -> float | None:
        xs = [r["p50_s"] for r in rows if r["side"] == side and r.get("p50_s")]
        return statistics.median(xs) if xs else None

    b, n = med("baseline"), med("now")
    pair_ratios = []
    for i in range(args.pairs):
        pb = next((r.get("p50_s") for r in rows if r["pair"] == i and r["side"] == "baseline"), None)
        pn = next((r.get("p50_s") for r in rows if r["pair"] == i and r["side"] == "now"), None)
        if pb and pn:
            pair_ratios.append(pb / pn)
    out = {"experiment": "flat_before_after", "baseline_commit": commit, "now_commit": now,
           "replicas": args.replicas, "rounds_per_row": args.rounds, "pairs": args.pairs, "rows": rows,
           "median_p50_s": {"baseline": b, "now": n},
           "ratio_of_medians_baseline_over_now": (b / n) if b and n else None,
           "pair_ratios_baseline_over_now": pair_ratios,
           "definition": "p50 of a flat round: last request to every replica holding the answer (scale.py)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("median_p50_s", "ratio_of_medians_baseline_over_now",
                                          "pair_ratios_baseline_over_now")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
