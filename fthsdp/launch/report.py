"""What happened in a fault-tolerant run, computed from its files.

Pure functions over the replicas' step records and the launcher's event log:
quorum changes, detection time (kill -> a survivor hears the replica is dead),
the survivors' stall (extra wall time of the step that straddles a failure over
their median step), and a timeline plot with the membership shaded.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass, field

from fthsdp.control.quorum import ring_key
from fthsdp.logs import read_metrics


@dataclass
class RunFiles:
    steps: dict[str, list[dict]]  # replica -> step records (one per commit, in order)
    detections: list[dict]
    done: dict[str, dict]
    events: list[dict]  # launcher: kill / stop / cont / restart / exit
    # replica -> its rollbacks: commits of steps first..last recorded before `time` were
    # discarded with a forked state (fthsdp.control.quorum, rule 6), kind "rollback" / "forked"
    rollbacks: dict[str, list[dict]] = field(default_factory=dict)
    # replica -> the lighthouse's verdict at its Leave: its final state forked (kind "forked")
    forked: dict[str, dict] = field(default_factory=dict)


def load_run(out_dir: str | pathlib.Path) -> RunFiles:
    out = pathlib.Path(out_dir)
    steps: dict[str, list[dict]] = {}
    detections: list[dict] = []
    done: dict[str, dict] = {}
    rollbacks: dict[str, list[dict]] = {}
    forked: dict[str, dict] = {}
    for path in sorted(out.glob("metrics-*.jsonl")):
        for r in read_metrics(path):
            kind = r.get("kind")
            if kind == "step":
                steps.setdefault(r["replica"], []).append(r)
            elif kind == "detection":
                detections.append(r)
            elif kind == "done":
                done[r["replica"]] = r
            if kind == "forked":
                forked[r["replica"]] = r
            if kind == "rollback" or (kind == "forked" and r.get("rolled_back")):
                first, last = (r["first"], r["last"]) if kind == "rollback" else r["rolled_back"]
                rollbacks.setdefault(r["replica"], []).append({"first": first, "last": last, "time": r["time"],
                                                               "kind": kind})
    events = read_metrics(out / "events.jsonl") if (out / "events.jsonl").exists() else []
    return RunFiles(steps, detections, done, events, rollbacks, forked)


def hashes_after_commits(run: RunFiles) -> dict[int, dict[str, str]]:
    """Per committed step (the step record's ``step``), each replica's state hash after it,
    leaving out the commits that replica later rolled back (a forked state it discarded when
    it was fenced: those commits are not in the job's lineage). Invariant 1 says every value
    of one step is the same."""
    by_step: dict[int, dict[str, str]] = {}
    for rid, recs in run.steps.items():
        rbs = run.rollbacks.get(rid, ())
        for r in recs:
            if "hash" not in r or any(rb["first"] <= r["step"] + 1 <= rb["last"] and r.get("time", r["end"]) < rb["time"]
                                      for rb in rbs):
                continue
            by_step.setdefault(r["step"], {})[rid] = r["hash"]
    return by_step


def median_step_s(records: list[dict], skip: int = 2) -> float:
    durations = [r["end"] - r["start"] for r in records[skip:]] or [r["end"] - r["start"] for r in records]
    return statistics.median(durations) if durations else float("nan")


@dataclass
class FailureReport:
    replica: str
    kind: str
    time: float
    step_at_fault: int | None
    detection_s: float | None  # kill -> first survivor learns it (heartbeat abort or new quorum)
    stall_s: dict[str, float] = field(default_factory=dict)  # survivor -> extra seconds
    straddling_step: dict[str, int] = field(default_factory=dict)


def quorum_changes(run: RunFiles) -> list[dict]:
    """(step, quorum id, members) at every change, as seen by any replica."""
    seen: dict[int, dict] = {}
    for recs in run.steps.values():
        for r in recs:
            q = r["quorum_id"]
            if q not in seen or r["step"] < seen[q]["step"]:
                seen[q] = {"step": r["step"], "quorum_id": q, "members": r["members"], "time": r["start"]}
    return [seen[q] for q in sorted(seen)]


def analyse_failures(run: RunFiles) -> list[FailureReport]:
    out = []
    for ev in run.events:
        if ev.get("kind") not in ("kill", "stop"):
            continue
        victim, t = str(ev["replica"]), ev["time"]
        # Detection: the first abort triggered by the lighthouse naming the victim,
        # else the first survivor to get a quorum without the victim: when that answer
        # came (quorum_at), not when its step began, which may precede the kill (a kill
        # between two steps: the survivors' next step starts, asks, and waits out the
        # detection window for the answer; its start said "detected in 0.01s").
        det = [d["time"] for d in run.detections if victim in d.get("dead", []) and d["time"] >= t]
        excl = [learned for rid, recs in run.steps.items() if rid != victim
                for r in recs if victim not in r["members"]
                and (learned := r.get("quorum_at") or r["start"]) >= t]
        detection = (min(det) - t) if det else ((min(excl) - t) if excl else None)
        rep = FailureReport(victim, ev["kind"], t, ev.get("step"), detection)
        # Survivors: the replicas that were healthy at the fault (the launcher
        # records them); one still starting up or restarting has no stall to report.
        survivors = {str(r) for r in ev["healthy"]} if "healthy" in ev else None
        for rid, recs in run.steps.items():
            if rid == victim or (survivors is not None and rid not in survivors):
                continue
            med = median_step_s(recs)
            hit = [r for r in recs if r["start"] <= t <= r["end"]] or [r for r in recs if r["start"] > t][:1]
            if hit:
                r = hit[0]
                rep.stall_s[rid] = (r["end"] - r["start"]) - med
                rep.straddling_step[rid] = r["step"]
        out.append(rep)
    return out


def summarize(out_dir: str | pathlib.Path) -> dict:
    run = load_run(out_dir)
    failures = analyse_failures(run)
    per_replica = {}
    for rid, recs in sorted(run.steps.items()):
        losses = [r["loss"] for r in recs if r.get("loss") is not None]
        per_replica[rid] = {
            "committed_steps": len(recs),
            "final_step": run.done.get(rid, {}).get("step", recs[-1]["step"] + 1 if recs else 0),
            "median_step_s": median_step_s(recs),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "retried_steps": sum(1 for r in recs if r["attempts"] > 1),
            "catch_up_steps": sum(1 for r in recs if not r["healthy"]),
        }
    hashes = {rid: d.get("hash") for rid, d in run.done.items()}
    finals = {rid: d.get("step") for rid, d in run.done.items()}
    return {
        "replicas": per_replica,
        "quorum_changes": quorum_changes(run),
        "failures": [f.__dict__ for f in failures],
        "final_hashes": hashes,
        "final_steps": finals,
        "identical_final_state": bool(hashes) and len(set(hashes.values())) == 1 and len(set(finals.values())) == 1,
        # split brain (fthsdp.control.quorum, rule 6): commits each replica discarded with a
        # forked state, and the replicas whose final state forked (no "done": not a final state)
        "rolled_back": {rid: [[rb["first"], rb["last"]] for rb in rbs] for rid, rbs in sorted(run.rollbacks.items())},
        "forked": {rid: f["reason"] for rid, f in sorted(run.forked.items())},
        "events": run.events,
    }


def describe(summary: dict) -> list[str]:
    """Human-readable lines for the end of a run."""
    lines = []
    for q in summary["quorum_changes"]:
        lines.append(f"quorum {q['quorum_id']} from step {q['step']}: members {q['members']}")
    for f in summary["failures"]:
        det = f"{f['detection_s']:.2f}s" if f["detection_s"] is not None else "n/a"
        stalls = ", ".join(f"replica {k}: {v:+.2f}s at step {f['straddling_step'][k]}" for k, v in f["stall_s"].items())
        lines.append(f"{f['kind']} of replica {f['replica']} (at step {f['step_at_fault']}): detected in {det}; "
                     f"survivors' stall {stalls or 'n/a'}")
    for lr in summary.get("lighthouse_restarts") or []:
        how = "its standby took over" if lr.get("standby") else "restarted"
        lines.append(f"lighthouse died ({lr['died']}); {how} in {lr['restart_s']:.2f}s")
    for rr in summary.get("relay_restarts") or []:
        lines.append(f"relay {rr['index']} died ({rr['died']}); restarted on its address in {rr['restart_s']:.2f}s")
    for jr in summary.get("job_restarts") or []:
        lines.append(f"no healthy replica left: whole job restarted from the checkpoint of step "
                     f"{jr['checkpoint']} (attempt {jr['attempt']})")
    if summary.get("faults_not_fired"):
        lines.append(f"faults not fired before the run ended: {summary['faults_not_fired']}")
    for rid, r in summary["replicas"].items():
        lines.append(f"replica {rid}: {r['committed_steps']} commits, median step {r['median_step_s'] * 1e3:.0f} ms, "
                     f"loss {r['first_loss'] or float('nan'):.3f} -> {r['last_loss'] or float('nan'):.3f}, "
                     f"{r['retried_steps']} retried, {r['catch_up_steps']} catch-up")
    for rid, spans in (summary.get("rolled_back") or {}).items():
        if rid not in (summary.get("forked") or {}):
            # ledger steps count committed steps: the step trained is one less (as in step records)
            lines.append(f"replica {rid} was fenced (its state forked from the job's lineage): its commits of steps "
                         + ", ".join(f"{a - 1}..{b - 1}" for a, b in spans) + " rolled back, fetched the lineage's state")
    for rid, why in (summary.get("forked") or {}).items():
        lines.append(f"replica {rid}: final state discarded: {why}")
    if not summary["final_hashes"]:
        lines.append("no replica finished the run")
    else:
        lines.append(f"final state identical on every finishing replica ({len(summary['final_hashes'])}): "
                     + ("yes" if summary["identical_final_state"] else f"NO {summary['final_hashes']}"))
    if summary.get("gave_up"):
        lines.append(f"the launcher ended the job: {summary['gave_up']}")
    return lines


def plot_timeline(out_dir: str | pathlib.Path, path: str | pathlib.Path | None = None,
                  num_configured: int | None = None) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = load_run(out_dir)
    out = pathlib.Path(path or pathlib.Path(out_dir) / "timeline.png")
    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True,
                                                    gridspec_kw={"height_ratios": [3, 2, 1]})
    members_by_step: dict[int, int] = {}
    for rid, recs in sorted(run.steps.items(),
                            key=lambda kv: ring_key(kv[0])):
        xs, ys = [], []
        for r in recs:
            if r.get("loss") is None:
                continue
            if xs and r["step"] != xs[-1] + 1:  # absent or catching up: break the line
                xs.append(xs[-1] + 0.5)
                ys.append(float("nan"))
            xs.append(r["step"])
            ys.append(r["loss"])
        ax_loss.plot(xs, ys, lw=1, label=f"replica {rid}")
        ax_time.plot([r["step"] for r in recs], [(r["end"] - r["start"]) * 1e3 for r in recs], ".", ms=3,
                     label=f"replica {rid}")
        for r in recs:
            members_by_step[r["step"]] = max(members_by_step.get(r["step"], 0), len(r["members"]))
    if members_by_step:
        steps = sorted(members_by_step)
        full = num_configured or max(members_by_step.values())
        ax_mem.step(steps, [members_by_step[s] for s in steps], where="post", color="k")
        ax_mem.set_ylim(0, full + 0.5)
        for s in steps:
            if members_by_step[s] < full:
                for ax in (ax_loss, ax_time, ax_mem):
                    ax.axvspan(s - 0.5, s + 0.5, color="tab:red", alpha=0.12, lw=0)
    for ev in run.events:
        if ev.get("kind") in ("kill", "stop", "restart") and ev.get("step") is not None:
            for ax in (ax_loss, ax_time):
                ax.axvline(ev["step"], color="tab:red" if ev["kind"] != "restart" else "tab:green", ls="--", lw=0.8)
            ax_loss.annotate(f"{ev['kind']} r{ev['replica']}", (ev["step"], ax_loss.get_ylim()[1]),
                             xytext=(-9 if ev["kind"] != "restart" else 3, 0), textcoords="offset points",
                             fontsize=7, va="top", rotation=90)
    ax_loss.set_ylabel("train loss")
    if run.steps:
        ax_loss.legend(fontsize=7)
    ax_time.set_ylabel("step time (ms)")
    ax_time.set_yscale("log")
    ax_mem.set_ylabel("ring size")
    ax_mem.set_xlabel("step (shaded: replicas missing)")
    for ax in (ax_loss, ax_time, ax_mem):
        ax.grid(alpha=0.3)
    fig.suptitle("fthsdp fault-tolerant run")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_summary(out_dir: str | pathlib.Path, extra: dict | None = None) -> dict:
    """summary.json: the run's analysis plus what the launcher adds (`extra`:
    attempts, automatic job restarts, lighthouse and relay restarts, faults fired)."""
    summary = {**summarize(out_dir), **(extra or {})}
    pathlib.Path(out_dir, "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
