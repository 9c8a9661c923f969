"""LR-intervention study: does sqrt(healthy/total) flatten the loss fluctuation failures cause?

    python experiments/lr_intervention.py [--quick] --out FILE.json [--config NAME] [key=value ...]

Reproduces the question of the FT-HSDP paper's section 6.2 (figures 8 and 9)
on our own model: a baseline without failures and every failure schedule of
the study (paper grammar `freq_fp_len_con_lr`, scaled by fthsdp.sim.schedules)
with every LR intervention (none / linear / sqrt), over several seeds, all
simulated by the numerical twin (fthsdp.sim.twin: the same jitted step code as
the replicas, N replicas in one process).

Measured per run, against the baseline of the same seed and dtype:
  held-out loss   every `eval_every` steps and at every step in a failure window
  max_dev/rms_dev max and RMS |held-out loss - baseline| inside the failure
                  windows (each failure's steps plus `window_margin` after)
  jitter          RMS of the step-to-step change of that deviation inside the
                  windows: the wiggle of the curve, without its offset
  final_gap       final held-out loss - baseline's (both after the same number
                  of batches: a run with failures trains extra steps, everyone
                  up, until it has seen the baseline's data; exactly once)
  train_*         the same on the training loss (trailing mean over `smooth` steps)
Runs are compared at equal data seen (batches consumed, the paper's
tokens-seen x-axis): the baseline curve is interpolated at the run's count.

The JSON holds the config, every run's curves, a `summary` list (one row per
schedule x intervention: means over seeds and their std as `<metric>_std`,
plus a `baseline` row that deviates 0 from itself) and a `conclusion`
computed from the summary. Plots: <out stem>_full.png (figure 8: whole
curves) and <out stem>_zoom.png (figure 9: the failure windows).

Overrides: `model.d_model=16`, `train.steps=60` (the Config) and
`study.seeds=0,1`, `study.schedules=d2x_fp32_for1k_1reps` (the StudyConfig).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Callable

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fthsdp import config as config_mod  # noqa: E402
from fthsdp.sim import schedules  # noqa: E402
from fthsdp.config import Config  # noqa: E402
from fthsdp.sim.schedules import StudyConfig  # noqa: E402

METRICS = ("max_dev", "rms_dev", "jitter", "final_gap", "train_max_dev", "train_rms_dev", "final_train_gap")


# -- configuration -------------------------------------------------------------


def load_study(name: str, overrides: list[str] = ()) -> tuple[Config, StudyConfig]:
    """Loads `config` and `study` from a configs/ module and applies `key=value` overrides."""
    module = config_mod.load_module(name)
    path = module.__file__
    cfg = module.config
    study = getattr(module, "study", None)
    if not isinstance(study, StudyConfig):
        raise config_mod.ConfigError(f"{path} must define a module-level `study = StudyConfig(...)`")
    cfg_over = [o for o in overrides if not o.startswith("study.")]
    study_over = [o[len("study."):] for o in overrides if o.startswith("study.")]
    cfg = config_mod.override(cfg, cfg_over)
    study = config_mod.override(study, study_over)
    study = dataclasses.replace(study, seeds=tuple(int(s) for s in study.seeds))
    return cfg.validate(), study.validate()


# -- metrics (pure) ------------------------------------------------------------


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` steps (shorter at the start)."""
    values = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def in_windows(steps: np.ndarray, windows: list[tuple[int, int]], margin: int) -> np.ndarray:
    """Which `steps` (1-based: after that many steps) fall inside a failure window or its margin."""
    steps = np.asarray(steps)
    mask = np.zeros(steps.shape, dtype=bool)
    for start, end in windows:
        mask |= (steps > start) & (steps <= end + margin)
    return mask


def deviation(run_x, run_y, base_x, base_y) -> np.ndarray:
    """run - baseline at equal data seen (baseline linearly interpolated at the run's x)."""
    return np.asarray(run_y, np.float64) - np.interp(np.asarray(run_x, np.float64),
                                                     np.asarray(base_x, np.float64), np.asarray(base_y, np.float64))


def fluctuation(dev: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """(max |dev|, RMS dev) over the masked points; (0, 0) if none."""
    d = np.asarray(dev)[np.asarray(mask)]
    if d.size == 0:
        return 0.0, 0.0
    return float(np.max(np.abs(d))), float(np.sqrt(np.mean(d * d)))


def jitter(steps: np.ndarray, dev: np.ndarray, mask: np.ndarray) -> float:
    """RMS of the per-step change of `dev` between consecutive masked points one step apart."""
    steps, dev, mask = np.asarray(steps), np.asarray(dev, np.float64), np.asarray(mask, bool)
    pair = mask[1:] & mask[:-1] & (np.diff(steps) == 1)
    d = np.diff(dev)[pair]
    return float(np.sqrt(np.mean(d * d))) if d.size else 0.0


def run_metrics(run: dict, base: dict, windows: list[tuple[int, int]], study: StudyConfig) -> dict:
    ev = np.asarray(run["evals"], dtype=np.float64)  # (k, 3): step, batches, loss
    bev = np.asarray(base["evals"], dtype=np.float64)
    dev = deviation(ev[:, 1], ev[:, 2], bev[:, 1], bev[:, 2])
    mask = in_windows(ev[:, 0], windows, study.window_margin)
    max_dev, rms_dev = fluctuation(dev, mask)
    steps = np.arange(1, len(run["train_loss"]) + 1)
    tdev = deviation(run["batches"], smooth(run["train_loss"], study.smooth),
                     base["batches"], smooth(base["train_loss"], study.smooth))
    tmax, trms = fluctuation(tdev, in_windows(steps, windows, study.window_margin))
    return {
        "max_dev": max_dev, "rms_dev": rms_dev, "jitter": jitter(ev[:, 0], dev, mask), "final_gap": float(ev[-1, 2] - bev[-1, 2]),
        "train_max_dev": tmax, "train_rms_dev": trms,
        "final_train_gap": float(smooth(run["train_loss"], study.smooth)[-1] - smooth(base["train_loss"], study.smooth)[-1]),
    }


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (schedule, intervention): mean over seeds, and std over seeds as `<metric>_std`."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["schedule"], r["intervention"]), []).append(r)
    rows = []
    for (sched, mode), rs in groups.items():
        row = {"schedule": sched, "intervention": mode, "runs": len(rs)}
        for k in METRICS:
            vals = np.array([r["metrics"][k] for r in rs], dtype=np.float64)
            row[k] = float(vals.mean())
            row[f"{k}_std"] = float(vals.std(ddof=1)) if vals.size > 1 else 0.0
        rows.append(row)
    return rows


def conclude(summary: list[dict], baseline_spread: float) -> dict:
    """What the numbers say about the paper's claims (computed, not written in advance)."""
    by = {(r["schedule"], r["intervention"]): r for r in summary}
    scheds = sorted({r["schedule"] for r in summary if r["schedule"] != "baseline"})
    per, lines = {}, []
    for s in scheds:
        rms = {m: by[(s, m)]["rms_dev"] for m in ("none", "linear", "sqrt") if (s, m) in by}
        entry = {"rms_dev": rms, "flattest": min(rms, key=rms.get) if rms else None}
        if "sqrt" in rms and "none" in rms:
            entry["sqrt_vs_none"] = rms["sqrt"] - rms["none"]
            # "clearly" = by more than the seed-to-seed spread of the two means
            spread = math.hypot(by[(s, "sqrt")]["rms_dev_std"], by[(s, "none")]["rms_dev_std"])
            entry["sqrt_flatter_than_none"] = rms["sqrt"] < rms["none"]
            entry["sqrt_clearly_flatter_than_none"] = rms["none"] - rms["sqrt"] > spread
        if "sqrt" in rms and "linear" in rms:
            entry["sqrt_vs_linear"] = rms["sqrt"] - rms["linear"]
            entry["sqrt_flatter_than_linear"] = rms["sqrt"] < rms["linear"]
        gaps = {m: by[(s, m)]["final_gap"] for m in rms}
        entry["final_gap"] = gaps
        entry["final_within_baseline_spread"] = {m: abs(g) <= max(baseline_spread, 1e-12) for m, g in gaps.items()}
        per[s] = entry
    n = len(scheds)
    n_none = sum(bool(per[s].get("sqrt_flatter_than_none")) for s in scheds)
    n_lin = sum(bool(per[s].get("sqrt_flatter_than_linear")) for s in scheds)
    n_clear = sum(bool(per[s].get("sqrt_clearly_flatter_than_none")) for s in scheds)
    n_flat = {m: sum(per[s]["flattest"] == m for s in scheds) for m in ("none", "linear", "sqrt")}
    lines.append(f"sqrt had a lower RMS deviation from the baseline than none in {n_none} of {n} schedules "
                 f"(by more than the seed spread in {n_clear}), and lower than linear in {n_lin} of {n}.")
    lines.append("Flattest intervention per schedule: " + ", ".join(f"{s}: {per[s]['flattest']}" for s in scheds) + ".")
    def smoother(other):
        return sum(by[(s, "sqrt")]["jitter"] < by[(s, other)]["jitter"] for s in scheds
                   if (s, "sqrt") in by and (s, other) in by)

    n_jit, n_jit_lin = smoother("none"), smoother("linear")
    lines.append(f"By jitter (the step-to-step wiggle of the deviation, without its offset) sqrt was smoother "
                 f"than none in {n_jit} of {n} schedules and than linear in {n_jit_lin} of {n}.")
    max_gap = max((abs(g) for s in scheds for g in per[s]["final_gap"].values()), default=0.0)
    back = {m: sum(per[s]["final_within_baseline_spread"].get(m, False) for s in scheds) for m in ("none", "linear", "sqrt")}
    mean_gap = {m: float(np.mean([per[s]["final_gap"][m] for s in scheds if m in per[s]["final_gap"]] or [0.0]))
                for m in ("none", "linear", "sqrt")}
    lines.append(f"Largest |final held-out loss gap| to the baseline: {max_gap:.4f}; final held-out loss within the "
                 f"baseline's seed-to-seed std ({baseline_spread:.4f}) in " +
                 ", ".join(f"{m} {back[m]}/{n}" for m in ("none", "linear", "sqrt")) +
                 " schedules; mean final gap " + ", ".join(f"{m} {mean_gap[m]:+.4f}" for m in mean_gap) + ".")
    agrees = n > 0 and n_none == n and n_lin == n
    lines.append("Flattening: AGREES with the paper (sqrt had a smaller deviation than none and linear in every schedule)."
                 if agrees else
                 "Flattening: DISAGREES with the paper in part (sqrt did not have the smallest deviation vs both none "
                 "and linear in every schedule).")
    final_agrees = n > 0 and back["sqrt"] == n
    lines.append("Final model: AGREES with the paper (with sqrt the final held-out loss is within the baseline's "
                 "seed-to-seed std in every schedule)." if final_agrees else
                 f"Final model: DISAGREES with the paper for sqrt (its final held-out loss is outside the baseline's "
                 f"seed-to-seed std in {n - back['sqrt']} of {n} schedules; none: {n - back['none']} of {n}).")
    return {"per_schedule": per, "sqrt_flatter_than_none": n_none, "sqrt_flatter_than_linear": n_lin,
            "sqrt_clearly_flatter_than_none": n_clear, "flattest_counts": n_flat, "schedules": n,
            "max_abs_final_gap": max_gap, "baseline_final_spread": baseline_spread,
            "final_within_baseline_spread": back, "mean_final_gap": mean_gap, "sqrt_smoother_than_none": n_jit,
            "sqrt_smoother_than_linear": n_jit_lin, "agrees_with_paper": agrees,
            "final_agrees_with_paper": final_agrees, "text": " ".join(lines)}


# -- the study -----------------------------------------------------------------


def _interventions(sched: schedules.FailureSchedule, study: StudyConfig) -> list[str]:
    return [sched.intervention] if sched.intervention else list(study.interventions)


def _curves(res) -> dict:
    return {
        "train_loss": [r.loss for r in res.steps],
        "batches": [r.batches for r in res.steps],
        "num_contributing": [r.num_contributing for r in res.steps],
        "lr": [r.lr for r in res.steps],
        "evals": [list(e) for e in res.evals],
    }


def run_study(cfg: Config, study: StudyConfig, *, log: Callable[[str], None] = print) -> dict:
    """Runs the baselines and every schedule x intervention x seed; returns the results dict."""
    import jax

    from fthsdp.sim.twin import Twin

    t0 = time.perf_counter()
    n = study.num_replicas or cfg.launch.replicas
    steps = cfg.train.steps
    rule = study.rule(steps, n)
    platform = jax.default_backend()
    parsed = [schedules.parse(s) for s in study.schedules]
    dtype_of = {p.name: (p.activation_dtype(platform) if study.honor_precision else cfg.model.dtype) for p in parsed}
    twins: dict[str, Twin] = {}

    def twin_for(dtype: str) -> Twin:
        if dtype not in twins:
            c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
            twins[dtype] = Twin(c, n)
        return twins[dtype]

    # Failure timing depends on the schedule and the rule, not the seed: evaluate densely there.
    scaled = {(p.name, seed): schedules.scale(p.with_intervention(None), rule, seed) for p in parsed for seed in study.seeds}
    dense = sorted({t for sc in scaled.values() for (a, b) in sc.windows
                    for t in range(a + 1, min(b + study.window_margin, steps) + 1)})
    union_windows = sorted({w for sc in scaled.values() for w in sc.windows})

    baselines: dict[tuple[str, int], dict] = {}
    for dtype in sorted(set(dtype_of.values())):
        for seed in study.seeds:
            res = twin_for(dtype).run(schedules.no_failures(steps, n), intervention="none", seed=seed,
                                      eval_every=study.eval_every, eval_steps=tuple(dense))
            baselines[(dtype, seed)] = _curves(res)
            log(f"baseline {dtype} seed {seed}: held-out {res.final_eval:.4f}")
    total_batches = steps * n

    runs = []
    for p in parsed:
        for seed in study.seeds:
            sc = scaled[(p.name, seed)]
            base = baselines[(dtype_of[p.name], seed)]
            for mode in _interventions(p, study):
                res = twin_for(dtype_of[p.name]).run(
                    sc.alive, intervention=mode, seed=seed, eval_every=study.eval_every,
                    eval_steps=tuple(dense), until_batches=total_batches)
                run = {"schedule": p.base_name, "name": p.with_intervention(mode).name, "intervention": mode,
                       "seed": seed, "precision": p.precision, "dtype": dtype_of[p.name],
                       "failures": [[f.start, f.end, list(f.replicas)] for f in sc.failures],
                       "extra_steps": len(res.steps) - steps, **_curves(res)}
                run["metrics"] = run_metrics(run, base, sc.windows, study)
                runs.append(run)
                m = run["metrics"]
                log(f"{run['name']:<32} seed {seed}: max_dev {m['max_dev']:.4f} rms_dev {m['rms_dev']:.4f} "
                    f"final_gap {m['final_gap']:+.4f}")

    # The baseline against itself, over every schedule's windows: zero by construction, checked.
    base_runs = []
    for (dtype, seed), b in baselines.items():
        base_runs.append({"schedule": "baseline", "intervention": "none", "seed": seed, "dtype": dtype,
                          "metrics": run_metrics(b, b, union_windows, study)})
    summary = summarize(base_runs) + summarize(runs)
    finals = [b["evals"][-1][2] for b in baselines.values()]
    spread = float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0
    conclusion = conclude(summary, spread)
    return {
        "config": config_mod.to_dict(cfg),
        "study": dataclasses.asdict(study),
        "num_replicas": n,
        "platform": platform,
        "tokens_per_batch": cfg.data.batch_size * cfg.data.seq_len,
        "scale_rule": {p.base_name: rule.describe(p) for p in parsed},
        "baselines": [{"dtype": d, "seed": s, **b} for (d, s), b in baselines.items()],
        "runs": runs,
        "summary": summary,
        "conclusion": conclusion,
        "elapsed_s": time.perf_counter() - t0,
    }


# -- plots ---------------------------------------------------------------------

COLORS = {"baseline": "black", "none": "tab:red", "linear": "tab:orange", "sqrt": "tab:blue"}


def _mean_curve(items: list[dict], key: str):
    """Mean over seeds of aligned curves (the batch counts per step do not depend on the seed)."""
    if key == "evals":
        k = min(len(r["evals"]) for r in items)
        ev = np.mean([np.asarray(r["evals"][:k], np.float64) for r in items], axis=0)
        return ev[:, 0], ev[:, 1], ev[:, 2]
    k = min(len(r[key]) for r in items)
    return (np.arange(1, k + 1), np.mean([r["batches"][:k] for r in items], axis=0),
            np.mean([r[key][:k] for r in items], axis=0))


def plot(results: dict, out_stem: pathlib.Path) -> list[pathlib.Path]:
    """Figure 8 (full curves vs tokens seen) and figure 9 (zoomed failure windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = results["study"]
    tok = results["tokens_per_batch"]
    scheds = list(dict.fromkeys(r["schedule"] for r in results["runs"]))
    if not scheds:
        return []
    modes = list(dict.fromkeys(r["intervention"] for r in results["runs"]))
    paths = []

    def group(s, m):
        return [r for r in results["runs"] if r["schedule"] == s and r["intervention"] == m]

    def base_for(s):
        dtype = group(s, modes[0])[0]["dtype"]
        return [b for b in results["baselines"] if b["dtype"] == dtype]

    # figure 8: whole training, train loss (smoothed) and held-out loss vs tokens seen
    fig, axes = plt.subplots(2, len(scheds), figsize=(4.6 * len(scheds), 6.5), squeeze=False)
    for j, s in enumerate(scheds):
        series = [("baseline", base_for(s))] + [(m, group(s, m)) for m in modes]
        for name, items in series:
            _, b, y = _mean_curve(items, "train_loss")
            axes[0, j].plot(b * tok, smooth(y, study["smooth"]), color=COLORS.get(name), lw=1, label=name)
            _, eb, ey = _mean_curve(items, "evals")
            axes[1, j].plot(eb * tok, ey, color=COLORS.get(name), lw=1, label=name)
        for f in group(s, modes[0])[0]["failures"]:
            for ax in axes[:, j]:
                ax.axvspan(f[0] * results["num_replicas"] * tok, f[1] * results["num_replicas"] * tok,
                           color="grey", alpha=0.15, lw=0)
        axes[0, j].set_title(s, fontsize=9)
        axes[1, j].set_xlabel("tokens seen")
    for ax in axes.ravel():
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes[0, 0].set_ylabel("training loss (smoothed)")
    axes[1, 0].set_ylabel("held-out loss")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("LR intervention: full training (cf. paper fig. 8); grey = failure windows, mean over seeds")
    fig.tight_layout()
    p = out_stem.parent / f"{out_stem.name}_full.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    # figure 9: zoom on the failure windows: held-out loss and its deviation from the baseline
    fig, axes = plt.subplots(2, len(scheds), figsize=(4.6 * len(scheds), 6.5), squeeze=False)
    for j, s in enumerate(scheds):
        fails = group(s, modes[0])[0]["failures"]
        lo = min(f[0] for f in fails) - study["window_margin"]
        hi = max(f[1] for f in fails) + study["window_margin"]
        bx, bb, by = _mean_curve(base_for(s), "evals")
        for name, items in [("baseline", base_for(s))] + [(m, group(s, m)) for m in modes]:
            x, b, y = _mean_curve(items, "evals")
            keep = (x >= lo) & (x <= hi)
            axes[0, j].plot(b[keep] * tok, y[keep], color=COLORS.get(name), lw=1, label=name)
            axes[1, j].plot(x[keep], deviation(b, y, bb, by)[keep], color=COLORS.get(name), lw=1, label=name)
        for f in fails:
            axes[1, j].axvspan(f[0], f[1], color="grey", alpha=0.15, lw=0)
        axes[0, j].set_title(s, fontsize=9)
        axes[0, j].set_xlabel("tokens seen")
        axes[1, j].set_xlabel("step")
        axes[1, j].axhline(0, color="black", lw=0.5)
    for ax in axes[0]:
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes[0, 0].set_ylabel("held-out loss")
    axes[1, 0].set_ylabel("held-out loss - baseline\n(at equal tokens)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("LR intervention: failure windows zoomed (cf. paper fig. 9), mean over seeds")
    fig.tight_layout()
    p = out_stem.parent / f"{out_stem.name}_zoom.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


def format_summary(summary: list[dict]) -> str:
    """The summary as a fixed-width table: mean±std over seeds."""
    cols = ("max_dev", "rms_dev", "jitter", "final_gap")
    head = f"{'schedule':<22} {'interv.':<7} " + " ".join(f"{c:>17}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in summary:
        cells = " ".join(f"{r[c]:>+8.4f}±{r[c + '_std']:<8.4f}" if c == "final_gap" else f"{r[c]:>8.4f}±{r[c + '_std']:<8.4f}"
                         for c in cols)
        lines.append(f"{r['schedule']:<22} {r['intervention']:<7} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the quick study (configs/lr_study_quick.py)")
    ap.add_argument("--config", default=None, help="a configs/ module defining `config` and `study`")
    ap.add_argument("--out", required=True, help="where to write the results JSON (plots go next to it)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value: model.d_model=16, study.seeds=0,1, ...")
    args = ap.parse_args(argv)
    name = args.config or ("lr_study_quick" if args.quick else "lr_study")

    from fthsdp.devices import enable_compilation_cache

    enable_compilation_cache()
    cfg, study = load_study(name, args.overrides)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = run_study(cfg, study, log=lambda s: print(s, flush=True))
    results["quick"] = bool(args.quick)
    results["config_name"] = name
    if not args.no_plots:
        results["plots"] = [str(p) for p in plot(results, out.with_suffix(""))]
    out.write_text(json.dumps(results, indent=1))
    print(format_summary(results["summary"]))
    print(results["conclusion"]["text"])
    print(f"wrote {out} in {results['elapsed_s']:.0f} s" + (f"; plots {', '.join(results.get('plots', []))}"))
    return results


if __name__ == "__main__":
    main()
