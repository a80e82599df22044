"""`slurmrl trace DUMP [--events EVENTS] [--metrics METRICS] [-o OUT.html]`: one self-contained HTML
timeline of a rollout dump's spans (rollout.trace), with the supervisor's events and the trainer's
training steps (metrics.jsonl's train_started_at/train_ended_at) on the same wall-time axis: with
asynchronous RL (train_async.py, the fully async rollout) the samples of rollout N generate while
rollout N-1 trains, and the page says for how long generation overlapped training.

Rows are samples, sorted by when they finished, so the long tail is the bottom rows; the samples
that finished in the last tenth of the round's time are marked. Bars are spans coloured by kind;
marks are zero-length spans (abort, resume) and events.jsonl's engine, router, trainer and node
events (failures red, recoveries green). No network: the data, CSS and JS are inline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from contract.job_dir import Metric
from rollout import debug_data
from rollout.trace import KINDS

# Events the timeline draws, by what they mean for the round (the rest of events.jsonl is left out).
_FAILURES = {"engine_failed", "engine_given_up", "engine_degraded", "engine_start_failed", "engine_restart_failed",
             "engines_stranded", "save_now_unanswered", "router_failed", "trainer_failed", "trainer_hung",
             "node_failed", "preemption", "job_failed"}
_RECOVERIES = {"engine_restarted", "engine_recovered", "engine_moved", "router_relaunched", "trainer_restarted",
               "requeue"}
_TAIL_FRACTION = 0.1  # samples ending in the round's last tenth are the long tail
_EVENT_MARGIN_S = 60.0  # events this close before or after the round are still drawn


class TraceError(ValueError):
    """Input the viewer cannot use; the message names the file and what is wrong."""


def load_dump(path: Path) -> dict[str, Any]:
    """A rollout dump (rollout.debug_data's, or slime's) as {"rollout_id", "samples": [dict]}."""
    try:
        data = debug_data.read_dump(path)
    except debug_data.DebugDataError as err:
        raise TraceError(f"not a rollout dump: {err}") from None
    return data


def load_events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise TraceError(f"--events {path} does not exist (the job dir's events.jsonl)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise TraceError(f"--events {path}: not text (is it a job's events.jsonl?)") from None
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            raise TraceError(f"--events {path}:{number}: not JSON (is it a job's events.jsonl?)") from None
        if not isinstance(event, dict) or not isinstance(event.get("time"), (int, float)) or "kind" not in event:
            raise TraceError(f"--events {path}:{number}: no 'time' and 'kind' (is it a job's events.jsonl?)")
        events.append(event)
    return events


def load_training(path: Path) -> list[dict[str, Any]]:
    """Each rollout's training interval from a job's metrics.jsonl (lines without one are skipped)."""
    if not path.is_file():
        raise TraceError(f"--metrics {path} does not exist (the job dir's metrics.jsonl)")
    out = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            raise TraceError(f"--metrics {path}: a line is not JSON (is it a job's metrics.jsonl?)") from None
        if isinstance(m, dict) and Metric.TRAIN_STARTED_AT in m and Metric.TRAIN_ENDED_AT in m:
            out.append({"rollout_id": m.get(Metric.ROLLOUT_ID), "start": float(m[Metric.TRAIN_STARTED_AT]),
                        "end": float(m[Metric.TRAIN_ENDED_AT])})
    return out


def overlap_s(spans: list[tuple[float, float]], training: list[tuple[float, float]]) -> float:
    """Seconds during which some generate span and some training interval both ran."""
    def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        merged: list[tuple[float, float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in union(spans) for s2, e2 in union(training))


def timeline(dump: dict[str, Any], events: list[dict[str, Any]],
             training: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What the page draws: rows sorted by end time, the tail marked, events and training in the window."""
    rows = []
    for sample in dump["samples"]:
        spans = [s for s in sample.get("spans") or [] if s.get("kind") in KINDS]
        if spans:
            rows.append({"index": sample.get("index"), "group": sample.get("group_index"),
                         "status": str(sample.get("status")), "reward": _number(sample.get("reward")),
                         "tokens": sample.get("response_length"), "spans": spans,
                         "end": max(s["end"] for s in spans), "start": min(s["start"] for s in spans)})
    rows.sort(key=lambda r: (r["end"], r["index"] if isinstance(r["index"], int) else 0))
    t0 = min((r["start"] for r in rows), default=0.0)
    t1 = max((r["end"] for r in rows), default=0.0)
    tail_from = t1 - _TAIL_FRACTION * (t1 - t0)
    for row in rows:
        row["tail"] = row["end"] >= tail_from and t1 > t0
    drawn = [{**e, "class": "failure" if e["kind"] in _FAILURES else "recovery"} for e in events
             if (e["kind"] in _FAILURES or e["kind"] in _RECOVERIES)
             and t0 - _EVENT_MARGIN_S <= e["time"] <= t1 + _EVENT_MARGIN_S]
    trained = [t for t in training or [] if t["end"] >= t0 - _EVENT_MARGIN_S and t["start"] <= t1 + _EVENT_MARGIN_S]
    generating = [(s["start"], s["end"]) for r in rows for s in r["spans"] if s["kind"] == "generate"]
    starts = [e["time"] for e in drawn] + [t["start"] for t in trained]
    ends = [e["time"] for e in drawn] + [t["end"] for t in trained]
    return {"rollout_id": dump.get("rollout_id"), "t0": min([t0, *starts]), "t1": max([t1, *ends]),
            "tail_from": tail_from, "rows": rows, "events": drawn, "training": trained,
            "overlap_s": overlap_s(generating, [(t["start"], t["end"]) for t in trained]),
            "kinds": list(KINDS), "samples": len(dump["samples"]), "span_count": sum(len(r["spans"]) for r in rows)}


def _number(value: Any) -> Any:
    return value if isinstance(value, (int, float)) or value is None else str(value)


def render(data: dict[str, Any]) -> str:
    # "</" escaped: the JSON sits inside a <script> element.
    payload = json.dumps(data, default=str).replace("</", "<\\/")
    return _PAGE.replace("__DATA__", payload)


def main(args: argparse.Namespace) -> int:
    try:
        dump = load_dump(args.dump)
        events = load_events(args.events) if args.events else []
        data = timeline(dump, events, load_training(args.metrics) if args.metrics else None)
        out = args.output or args.dump.with_suffix(".trace.html")
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(render(data))
        tmp.replace(out)  # never half a page
    except (TraceError, OSError) as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return 1
    note = "" if data["span_count"] else " (the dump holds no spans: made before rollout.trace)"
    trained = (f", {len(data['training'])} training steps, generation overlapping training for "
               f"{data['overlap_s']:.2f} s" if args.metrics else "")
    print(f"wrote {out}: {len(data['rows'])} samples, {data['span_count']} spans, "
          f"{len(data['events'])} events{trained}{note}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("trace", help="write an HTML timeline of a rollout dump's per-sample spans")
    parser.add_argument("dump", type=Path, help="a rollout dump (--save-debug-rollout-data's file)")
    parser.add_argument("--events", type=Path, help="a job dir's events.jsonl: engine failures and recoveries "
                        "drawn on the same time axis")
    parser.add_argument("--metrics", type=Path, help="a job dir's metrics.jsonl: the trainer's training steps drawn "
                        "on the same time axis (generation overlapping training, with asynchronous RL)")
    parser.add_argument("-o", "--output", type=Path, help="the HTML file (default: DUMP with .trace.html)")
    parser.set_defaults(func=main, prog=parser.prog)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slurmrl trace</title>
<style>
body{font:12px sans-serif;margin:12px;color:#222;overflow-x:hidden}
#legend span{display:inline-block;margin-right:10px}
#legend i{display:inline-block;width:12px;height:10px;margin-right:3px;vertical-align:middle}
#chart{position:relative;border-top:1px solid #ccc;margin-top:16px}
.row{position:relative;height:14px;border-bottom:1px solid #f2f2f2}
.row.tail{background:#fff4e0}
.label{position:absolute;left:0;width:150px;overflow:hidden;white-space:nowrap;font-size:10px;line-height:14px}
.lane{position:absolute;left:155px;right:10px;top:0;bottom:0}
.span{position:absolute;top:2px;height:10px;min-width:1px;opacity:.9}
.span.mark{width:2px;top:0;height:14px;min-width:2px}
.event{position:absolute;top:0;width:2px;opacity:.7}
.event-label{position:absolute;top:-14px;left:3px;font-size:10px;white-space:nowrap;background:#fffc}
.event.failure{background:#d00}.event.recovery{background:#080}
.k-queued{background:#bbb}.k-generate{background:#3b7dd8}.k-retry_wait{background:#f0a}.k-abort{background:#d00}
.k-resume{background:#0a0}.k-reward{background:#e90}.k-filter{background:#7a3}.k-train{background:#555}
.row.trainer{background:#eee}
.span.failed{background:repeating-linear-gradient(45deg,#d33,#d33 3px,#3b7dd8 3px,#3b7dd8 6px)}
#tip{position:fixed;display:none;background:#ffe;border:1px solid #999;padding:4px;white-space:pre;z-index:9}
</style></head><body>
<h3 id="title"></h3><div id="summary"></div><div id="legend"></div><div id="axis"></div><div id="chart"></div>
<div id="tip"></div>
<script id="trace-data" type="application/json">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("trace-data").textContent);
const t0 = data.t0, width = Math.max(data.t1 - t0, 1e-3);
const pct = t => (100 * (t - t0) / width) + "%";
const el = (tag, cls, parent) => { const e = document.createElement(tag); if (cls) e.className = cls;
  parent.appendChild(e); return e; };
const tip = document.getElementById("tip");
const describe = o => Object.entries(o).filter(([k, v]) => v !== null && v !== undefined && k !== "class")
  .map(([k, v]) => k + ": " + (k === "start" || k === "end" || k === "time" ? (v - t0).toFixed(3) + " s" : v))
  .join("\\n");
const hover = (node, text) => { node.addEventListener("mousemove", ev => { tip.textContent = text;
  tip.style.display = "block"; tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px"; });
  node.addEventListener("mouseleave", () => { tip.style.display = "none"; }); };
document.getElementById("title").textContent = "rollout " + data.rollout_id + ": " + data.rows.length +
  " samples with spans (of " + data.samples + "), " + data.span_count + " spans, " + data.events.length + " events";
const tail = data.rows.filter(r => r.tail).length;
document.getElementById("summary").textContent = "rows sorted by end time; shaded rows (" + tail +
  ") finished in the round's last tenth: the long tail. Round: " + width.toFixed(2) +
  " s. Red/green lines: failures/recoveries.";
const legend = document.getElementById("legend");
for (const k of data.kinds) { const s = el("span", "", legend); el("i", "k-" + k, s); s.append(k); }
const chart = document.getElementById("chart");
if (data.training.length) {
  const r = el("div", "row trainer", chart);
  el("div", "label", r).textContent = "trainer (overlap " + data.overlap_s.toFixed(2) + " s)";
  const lane = el("div", "lane", r);
  for (const t of data.training) {
    const b = el("div", "span k-train", lane);
    b.style.left = pct(t.start);
    b.style.width = (100 * Math.max(t.end - t.start, 0) / width) + "%";
    hover(b, "training rollout " + t.rollout_id + "\\n" + describe(t));
  }
}
for (const row of data.rows) {
  const r = el("div", "row" + (row.tail ? " tail" : ""), chart);
  el("div", "label", r).textContent = "s" + row.index + " g" + row.group + " " + row.status + " r=" + row.reward;
  const lane = el("div", "lane", r);
  for (const s of row.spans) {
    const failed = s.kind === "generate" && s.outcome && !["stop", "length", "abort", "completed",
      "truncated", "aborted"].includes(s.outcome);
    const b = el("div", "span k-" + s.kind + (s.end <= s.start ? " mark" : "") + (failed ? " failed" : ""), lane);
    b.style.left = pct(s.start);
    if (s.end > s.start) b.style.width = (100 * (s.end - s.start) / width) + "%";
    hover(b, "sample " + row.index + "\\n" + describe(s));
  }
}
for (const e of data.events) {
  const m = el("div", "event " + e.class, chart);
  m.style.left = "calc(155px + (100% - 165px) * " + ((e.time - t0) / width) + ")";
  m.style.height = "100%";
  el("span", "event-label", m).textContent = e.kind + (e.step ? " " + e.step : "");
  hover(m, describe(e));
}
document.body.dataset.rendered = String(document.querySelectorAll(".span").length);
</script></body></html>
"""
