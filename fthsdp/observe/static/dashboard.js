// fthsdp dashboard: polls /api/status and renders each job. Plain DOM, no
// framework, no build step. Every string from the server goes through
// textContent (never innerHTML), so a replica id or a reason cannot inject markup.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const params = new URLSearchParams(location.search);
// A number from the URL, or the default when it is not one (NaN would poll in a tight loop).
function numberParam(name, fallback, least) {
  const v = Number(params.get(name));
  return Number.isFinite(v) && params.get(name) !== null ? Math.max(least, v) : fallback;
}
const INTERVAL_MS = numberParam("interval", 1000, 200);
const WINDOW_S = numberParam("window", 300, 10); // timeline span
const STATE_WORD = { healthy: "healthy", behind: "behind", waiting: "waiting", outside: "outside", dead: "DEAD" };

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "dataset") Object.assign(e.dataset, v); else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function seconds(s) {
  if (s === null || s === undefined) return "—";
  if (s < 0) return "never";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${(s / 60).toFixed(1)} min`;
}

function byRing(a, b) { // numeric ids numerically, others after, by name
  const na = /^\d+$/.test(a), nb = /^\d+$/.test(b);
  if (na && nb) return Number(a) - Number(b);
  if (na !== nb) return na ? -1 : 1;
  return a < b ? -1 : a > b ? 1 : 0;
}

function renderSummary(job) {
  const q = job.quorum;
  const kv = (label, value, cls) => el("span", { class: "kv" }, `${label} `, el("b", { class: cls || "" }, value));
  const box = el("div", { class: "summary" });
  if (q) {
    box.append(kv("quorum", String(q.quorum_id), "quorum-id"), kv("step", String(q.max_step), "max-step"),
      kv("members", `${q.members.length}${job.num_configured ? " / " + job.num_configured : ""}`, "quorum-size"),
      kv("healthy", q.healthy.join(", ") || "—", "healthy"), kv("behind", q.behind.join(", ") || "—", "behind"),
      kv("decisions seen", String(job.decisions), "decisions"));
  } else {
    box.append(el("span", { class: "empty quorum-id" }, "no quorum yet"));
  }
  // A replica left having trained every step: the lighthouse keeps the job a while, short of members.
  if (job.finished_step !== null && job.finished_step !== undefined) {
    box.append(kv("finished at step", String(job.finished_step), "finished"));
  }
  return box;
}

// The root-cause verdict: who stalls the job and why (the lighthouse's
// wait-for graph analysis). The current one, and the last one that named a
// culprit while the job is fine again.
function renderRootCause(job) {
  const box = el("div", { class: "rootcause" });
  const one = (label, v, cls) => {
    // a replica of several processes: the culprit's process (0 / -1 / absent: not shown)
    const proc = v.process > 0 ? ` process ${v.process}` : "";
    const who = v.kind === "slow_link" ? `link ${v.culprit}${proc} → ${v.peer}` : v.culprit ? `replica ${v.culprit}${proc}` : "";
    return el("div", { class: `verdict ${cls} kind-${v.kind}`,
                       dataset: { kind: v.kind, culprit: v.culprit, peer: v.peer, process: v.process ?? -1 } },
      el("span", { class: "label" }, label), " ",
      el("b", { class: "kind" }, v.kind === "none" ? "no stall" : v.kind.replace("_", " ").toUpperCase()), " ",
      el("b", { class: "culprit" }, who), " ",
      el("span", { class: "muted" }, v.kind === "none" ? "" :
        `(confidence ${v.confidence.toFixed(2)}, step ${v.step}, ${seconds(v.age_s)} ago)`),
      el("div", { class: "evidence" }, v.evidence));
  };
  if (job.root_cause) box.append(one("root cause now:", job.root_cause, "current"));
  else box.append(el("div", { class: "verdict current empty" }, "root cause: not analysed yet"));
  if (job.last_stall && (!job.root_cause || job.root_cause.kind === "none")) {
    box.append(one("last stall:", job.last_stall, "last"));
  }
  return box;
}

// Silent data corruption: fingerprint mismatches between replicas that committed the same step.
function renderSdc(job) {
  if (!job.sdc_events || !job.sdc_events.length) return [];
  const box = el("div", { class: "sdc" });
  for (const e of job.sdc_events.slice(-5)) {
    box.append(el("div", { class: `sdc-event${e.fatal ? " fatal" : ""}`, dataset: { step: e.step, culprits: e.culprits.join(",") } },
      el("b", {}, e.fatal ? "SDC, job stopped: " : `SDC: replica ${e.culprits.join(", ")} condemned: `), e.reason));
  }
  return [el("h3", {}, "silent data corruption"), box];
}

function phaseText(r) {
  if (!r.phase) return "—";
  return `${r.phase} ${seconds(r.phase_s)}${r.waiting_on ? ` (waits on ${r.waiting_on})` : ""}`;
}

function renderReplicas(job) {
  const t = el("table", { class: "replicas" },
    el("thead", {}, el("tr", {}, el("th", {}, "replica"), el("th", {}, "state"), el("th", {}, "step"),
      el("th", {}, "heartbeat age"), el("th", {}, "step time"), el("th", {}, "phase"))));
  const body = el("tbody");
  for (const r of [...job.replicas].sort((a, b) => byRing(a.replica_id, b.replica_id))) {
    body.append(el("tr", { class: `replica state-${r.state}`, dataset: { replica: r.replica_id, state: r.state } },
      el("td", { class: "rid" }, r.replica_id),
      el("td", {}, el("span", { class: `badge st-${r.state}` }, STATE_WORD[r.state] || r.state)),
      el("td", { class: "num step" }, String(r.step)),
      el("td", { class: "num hb" }, seconds(r.heartbeat_age_s)),
      el("td", { class: "num steptime" }, seconds(r.step_s)),
      el("td", { class: "phase" }, phaseText(r))));
  }
  t.append(body);
  return t;
}

// Membership over time: one row per replica, a coloured run per state, a
// dashed line and the new id at every quorum change.
function renderTimeline(job, now) {
  const samples = job.timeline;
  if (!samples.length) return el("p", { class: "empty" }, "no samples yet");
  const ids = new Set();
  for (const s of samples) for (const r of Object.keys(s.states)) ids.add(r);
  const rows = [...ids].sort(byRing);
  const W = 1000, left = 70, right = 12, top = 22, rowH = 20, gap = 6, bottom = 22;
  const H = top + rows.length * (rowH + gap) + bottom;
  const t1 = Math.max(now, samples[samples.length - 1].t);
  const t0 = Math.max(samples[0].t, t1 - WINDOW_S);
  const span = Math.max(1, t1 - t0);
  const x = (t) => left + ((Math.max(t, t0) - t0) / span) * (W - left - right);
  const g = svg("svg", { class: "timeline", viewBox: `0 0 ${W} ${H}`, role: "img",
    "aria-label": `membership of job ${job.job_id} over time` });
  rows.forEach((rid, i) => {
    const y = top + i * (rowH + gap);
    g.append(svg("text", { x: 8, y: y + rowH * 0.72 }, `replica ${rid}`));
    let runStart = null, runState = null;
    const flush = (end) => {
      if (runState !== null && end > t0) {
        const x0 = x(runStart), x1 = Math.max(x(end), x0 + 1);
        const rect = svg("rect", { x: x0, y, width: x1 - x0, height: rowH, class: `st-${runState}`,
          "data-replica": rid, "data-state": runState });
        rect.style.fill = `var(--${runState})`;
        rect.append(svg("title", {}, `replica ${rid}: ${runState} ${clock(runStart)}–${clock(end)}`));
        g.append(rect);
      }
    };
    for (let k = 0; k < samples.length; k++) {
      const st = samples[k].states[rid] ?? null;
      if (st !== runState) { flush(samples[k].t); runStart = samples[k].t; runState = st; }
    }
    flush(t1);
  });
  let prevQ = null;
  for (const s of samples) {
    if (s.quorum_id !== prevQ && s.quorum_id && s.t >= t0) {
      const xq = x(s.t);
      g.append(svg("line", { class: "qline", x1: xq, x2: xq, y1: top - 4, y2: H - bottom }));
      g.append(svg("text", { class: "qlabel", x: xq + 2, y: top - 8 }, `q${s.quorum_id}`));
    }
    prevQ = s.quorum_id;
  }
  g.append(svg("line", { class: "axis", x1: left, x2: W - right, y1: H - bottom + 2, y2: H - bottom + 2 }));
  for (let k = 0; k <= 4; k++) {
    const t = t0 + (span * k) / 4;
    g.append(svg("text", { x: Math.min(x(t), W - right - 50), y: H - 6 }, clock(t)));
  }
  return g;
}

function renderFailures(job) {
  if (!job.failures.length) return el("p", { class: "empty failures-none" }, "no failures seen");
  const t = el("table", { class: "failures" },
    el("thead", {}, el("tr", {}, el("th", {}, "when"), el("th", {}, "replica"), el("th", {}, "what"),
      el("th", {}, "detected after (silence)"), el("th", {}, "job stalled"), el("th", {}, "lost from quorum"),
      el("th", {}, "back in a quorum after"))));
  const body = el("tbody");
  for (const f of job.failures) {
    body.append(el("tr", { class: "failure", dataset: { replica: f.replica, kind: f.kind, back: f.back_time ? "1" : "0" } },
      el("td", {}, clock(f.time)), el("td", {}, f.replica), el("td", {}, f.kind),
      el("td", { class: "num" }, seconds(f.silence_s)),
      el("td", { class: "num stall" }, f.stall_s === null ? "still stalled" : seconds(f.stall_s)),
      el("td", { class: "num" }, String(f.quorum_id)),
      el("td", { class: "num back" }, f.back_after_s === null ? "not yet" : seconds(f.back_after_s))));
  }
  t.append(body);
  return t;
}

function render(data) {
  document.getElementById("lighthouse").textContent = data.lighthouse;
  const state = document.getElementById("conn-state");
  state.textContent = data.up ? "up" : "unreachable";
  state.className = `pill ${data.up ? "up" : "down"}`;
  document.getElementById("updated").textContent = clock(data.time);
  // Failure detection in force: wider than configured while the lighthouse paces the beats.
  const paced = data.beat_interval_s > 0 ? `; beats paced to one every ${+data.beat_interval_s.toPrecision(3)} s ` +
    "by the lighthouse's beat budget (fthsdp lighthouse --beats-per-s)" : "";
  document.getElementById("detection").textContent =
    data.detect_s == null ? "" : `· failure detection ${+data.detect_s.toPrecision(3)} s of silence${paced}`;
  const err = document.getElementById("error");
  err.hidden = !data.error;
  err.textContent = data.error || "";
  const main = document.getElementById("jobs");
  const sections = data.jobs.map((job) => el("section", { class: "job", dataset: { job: job.job_id } },
    el("h2", {}, "job ", el("code", {}, job.job_id)),
    renderSummary(job),
    el("div", { class: "reason", title: "why the lighthouse formed the current quorum" },
      `last decision: ${job.last_reason || "—"}`),
    el("h3", {}, "who is stalling the job"), renderRootCause(job),
    ...renderSdc(job),
    el("h3", {}, "replicas"), renderReplicas(job),
    el("h3", {}, "membership timeline"), renderTimeline(job, data.time),
    el("h3", {}, "recent failures"), renderFailures(job)));
  if (!sections.length) sections.push(el("p", { class: "muted", id: "no-jobs" }, "the lighthouse has no jobs yet"));
  main.replaceChildren(...sections);
}

async function poll() {
  try {
    const resp = await fetch("/api/status", { cache: "no-store" });
    if (!resp.ok) throw new Error(`/api/status answered ${resp.status}`);
    render(await resp.json());
  } catch (e) {
    const err = document.getElementById("error");
    err.hidden = false;
    err.textContent = `dashboard server unreachable: ${e.message}`;
    const state = document.getElementById("conn-state");
    state.textContent = "no server";
    state.className = "pill down";
  } finally {
    setTimeout(poll, INTERVAL_MS);
  }
}

poll();
