"""Per-sample spans (rollout.trace) through real rounds: two CPU engines behind the real router, one
SIGKILLed mid-round, so its in-flight samples are retried elsewhere; a dynamic-sampling, partial
rollout for the filter, abort and resume marks. The dump keeps the spans (older dumps still
load); `slurmrl trace` writes one HTML page that a real headless Chromium loads without a JS
error, drawing one bar per span in the dump."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests
import torch

from jobs import cli
from rollout import debug_data, trace
from rollout.generate import generate_rollout
from rollout.sample import Sample, Status
from slurm.devcluster.daemons import wait_for
from supervisor.events import EventLog
from tests.rollout.servers import API_KEY
from tests.rollout.test_generate_rollout import _args, _buffer

BROWSER_TIMEOUT_S = 60  # one headless page load; far more than the few hundred ms it takes
DONE = ("stop", "length")
ABORT_EVERY_S = 0.05  # aborts sent to the engines during a round (~1 s): several land mid-generation


def _spans(sample: Sample, kind: str) -> list[dict]:
    return [s for s in sample.spans if s["kind"] == kind]


def test_spans_show_queue_retries_on_another_engine_and_reward(cluster, model: Path, tmp_path: Path) -> None:
    router, (victim, _) = cluster
    dump_template, events_path = str(tmp_path / "dump_{rollout_id}.pt"), tmp_path / "events.jsonl"
    args = replace(_args(model, router), rollout_concurrency=8, save_debug_rollout_data=dump_template)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(groups=generate_rollout(args, 0, _buffer(tmp_path))))
    worker.start()
    wait_for(lambda: victim.served() >= 4, 120, "the victim engine to serve a few requests")
    with EventLog(events_path) as events:  # what the supervisor would write, for the viewer's event lane
        events.emit("engine_failed", step="engine-0", url=victim.url, reason="SIGKILL")
        os.kill(victim.proc.pid, signal.SIGKILL)
        worker.join(timeout=300)
        events.emit("engine_restarted", step="engine-0")
    assert not worker.is_alive(), "the round did not finish with one engine left"
    samples = [s for g in result["groups"] for s in g]

    for s in samples:
        queued, generate, reward = _spans(s, "queued"), _spans(s, "generate"), _spans(s, "reward")
        assert queued and generate and len(reward) == 1, f"sample {s.index}: {[x['kind'] for x in s.spans]}"
        assert all(x["start"] <= x["end"] for x in s.spans)
        assert [g["attempt"] for g in generate] == list(range(len(generate)))
        assert generate[-1]["outcome"] in DONE and generate[-1]["weight_version"] == 1
        assert queued[0]["start"] <= generate[0]["start"] and reward[0]["start"] >= generate[-1]["end"]
        assert reward[0]["weight_version"] == 1
    retried = [s for s in samples if len(_spans(s, "generate")) > 1]
    assert retried, "no sample was retried after the kill"
    for s in retried:
        first, *_, last = _spans(s, "generate")
        # The router names the engine when it could not reach it; when the engine died while sending
        # its answer, the router's error (read_response_body_failed) names none.
        named = first["engine"] == victim.url or (first["engine"] is None
                                                 and "read_response_body_failed" in first["error"])
        assert named and first["outcome"].startswith("HTTP 5"), first
        assert last["attempt"] > first["attempt"] and last["outcome"] in DONE
        assert any(first["end"] <= w["start"] <= last["start"] for w in _spans(s, "retry_wait"))

    dump = tmp_path / "dump_0.pt"  # the spans are in the dump, and load back as they were
    loaded = {s.index: s.spans for g in debug_data.load(dump_template, 0) for s in g}
    assert loaded == {s.index: s.spans for s in samples}

    page = tmp_path / "trace.html"
    assert cli.main(["trace", str(dump), "--events", str(events_path), "-o", str(page)]) == 0
    html = page.read_text()
    assert "<script src" not in html and "http://" not in html.split("trace-data")[0], "the page must be offline"
    _check_in_browser(page, tmp_path, spans=sum(len(s.spans) for s in samples), events=2)


def test_filter_abort_and_resume_marks_of_a_partial_rollout(cluster, model: Path, tmp_path: Path) -> None:
    router, engines = cluster
    args = replace(_args(model, router), rollout_batch_size=4, over_sampling_batch_size=12, partial_rollout=True,
                   rollout_concurrency=8, rollout_max_response_len=48,
                   dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters."
                                                "check_reward_nonzero_std",
                   custom_rm_path="tests.rollout.test_generate_rollout.reward_by_index")
    buffer, stop = _buffer(tmp_path), threading.Event()

    def abort_now_and_then() -> None:  # what a weight update's pause does to the requests running
        while not stop.wait(ABORT_EVERY_S):
            for engine in engines:
                requests.post(engine.url + "/abort_request", json={"abort_all": True}, timeout=5,
                              headers={"Authorization": f"Bearer {API_KEY}"})

    aborter = threading.Thread(target=abort_now_and_then)
    aborter.start()
    try:
        first = [s for g in generate_rollout(args, 0, buffer) for s in g]
    finally:
        stop.set()
        aborter.join()
    assert all(len(_spans(s, "filter")) == 1 and _spans(s, "filter")[0]["kept"] for s in first)
    resumed = [s for s in first if _spans(s, "resume")]
    assert resumed, "no sample was aborted and continued"
    for s in resumed:
        generate = _spans(s, "generate")
        assert _spans(s, "abort")[0]["start"] <= _spans(s, "resume")[0]["start"]
        assert _spans(s, "resume")[0]["rollout_id"] == 0 and "abort" in [g["outcome"] for g in generate]
        assert [g["attempt"] for g in generate] == list(range(len(generate))) and generate[-1]["outcome"] in DONE
    # The round's end aborts what still runs; a partial rollout continues those in the next round.
    carried = {s.index: len(_spans(s, "generate")) for g in buffer.pending for s in g if s.status is Status.ABORTED}
    second = {s.index: s for g in generate_rollout(replace(args, rollout_batch_size=8), 1, buffer) for s in g}
    for index, attempts in carried.items():
        resume = [r for r in _spans(second[index], "resume") if r["rollout_id"] == 1]
        assert resume, f"sample {index} was continued without a resume mark"
        later = [g for g in _spans(second[index], "generate") if g["start"] >= resume[0]["start"]]
        assert later and later[0]["attempt"] == attempts, "attempts are not counted over rounds"


def test_an_older_dump_without_spans_still_loads_and_renders(tmp_path: Path, capsys) -> None:
    sample = Sample(index=0, group_index=0, prompt="p", status=Status.COMPLETED, reward=1.0)
    debug_data.save(str(tmp_path / "d{rollout_id}.pt"), 0, [sample])
    data = torch.load(tmp_path / "d0.pt", weights_only=False)
    del data["samples"][0]["spans"]  # as written before rollout.trace
    torch.save(data, tmp_path / "d0.pt")
    assert debug_data.load(str(tmp_path / "d{rollout_id}.pt"), 0)[0][0].spans == []
    assert cli.main(["trace", str(tmp_path / "d0.pt")]) == 0
    assert "0 spans" in capsys.readouterr().out and (tmp_path / "d0.trace.html").is_file()


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"), ("garbage", "not a torch.save file"), ("no_samples", "no 'samples' list"),
    ("bad_events", "events.jsonl?"), ("missing_events", "--events"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys, case: str, message: str) -> None:
    dump, events, out = tmp_path / "dump.pt", tmp_path / "events.jsonl", tmp_path / "out.html"
    debug_data.save(str(dump), 0, [Sample(index=0, group_index=0, prompt="p")])
    events.write_text('{"time": 1.0, "kind": "engine_failed"}\n')
    argv = {"missing": [str(tmp_path / "nope.pt")], "garbage": [str(events)],
            "no_samples": [str(tmp_path / "list.pt")], "bad_events": [str(dump), "--events", str(dump)],
            "missing_events": [str(dump), "--events", str(tmp_path / "nope.jsonl")]}[case]
    torch.save([1, 2], tmp_path / "list.pt")
    assert cli.main(["trace", *argv, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("slurmrl trace: error:"), err
    assert not out.exists()


def test_span_records_an_error_and_refuses_an_unknown_kind() -> None:
    sample = Sample(index=0, group_index=0, prompt="p")
    with pytest.raises(RuntimeError), trace.span(sample, "reward"):
        raise RuntimeError("reward server down")
    assert sample.spans[0]["error"] == "RuntimeError: reward server down"
    with pytest.raises(ValueError, match="span kind 'decode'"):
        trace.add(sample, "decode", 0.0)


def _check_in_browser(page: Path, tmp_path: Path, spans: int, events: int) -> None:
    """Chromium loads the page headless: no JS error on its console, one bar per span, the events drawn."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/install.sh installs it with apt-get)")
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--enable-logging=stderr",
            "--v=0", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", page.as_uri()]
    # Its own session: chromium's helper processes are stopped with it, by its process group id.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        dom, log = proc.communicate(timeout=BROWSER_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _wait_group_gone(proc.pid)
    assert proc.returncode == 0, log[-2000:]
    console = [line for line in log.splitlines() if "CONSOLE" in line]
    assert not console, f"the page logged to its console: {console}"
    assert f'data-rendered="{spans}"' in dom, "the script did not finish rendering"
    assert len(re.findall(r'class="span k-', dom)) == spans
    assert len(re.findall(r'class="event (?:failure|recovery)"', dom)) == events


def _wait_group_gone(pgid: int) -> None:
    """Chromium's helpers leave with it; stop any left over, by the group id, within the bound."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)


def test_the_trainer_row_shows_generation_overlapping_training(tmp_path: Path, capsys) -> None:
    """Asynchronous RL: rollout 1's samples generate while rollout 0 trains (metrics.jsonl's
    train_started_at/train_ended_at); the page draws the trainer's row and says for how long."""
    samples = []
    for index, (start, end) in enumerate([(10.0, 12.0), (13.0, 15.0)]):
        sample = Sample(index=index, group_index=0, prompt="p", status=Status.COMPLETED, reward=1.0)
        trace.add(sample, "generate", start, end, attempt=1)
        samples.append(sample)
    debug_data.save(str(tmp_path / "d{rollout_id}.pt"), 1, samples)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in (
        {"rollout_id": 0, "train_started_at": 11.0, "train_ended_at": 14.0},
        {"rollout_id": 1, "train_started_at": 16.0, "train_ended_at": 17.0})))
    assert cli.main(["trace", str(tmp_path / "d1.pt"), "--metrics", str(metrics)]) == 0
    assert "2 training steps, generation overlapping training for 2.00 s" in capsys.readouterr().out
    page = tmp_path / "d1.trace.html"
    assert '"overlap_s": 2.0' in page.read_text()
    _check_in_browser(page, tmp_path, spans=2 + 2, events=0)  # the samples' bars and the trainer's
