"""events.jsonl: one durable line per event, from many threads; follow sees new lines as they come."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from supervisor.events import EventLog, follow


def test_each_event_is_one_complete_json_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        threads = [threading.Thread(target=lambda k=k: [log.emit("engine_failed", f"engine-{k}", i=i)
                                                        for i in range(50)]) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(events) == 200
    assert {e["kind"] for e in events} == {"engine_failed"}
    for k in range(4):
        assert [e["i"] for e in events if e["step"] == f"engine-{k}"] == list(range(50))
    assert all(isinstance(e["time"], float) and e["iso"].endswith("+00:00") for e in events)


def test_follow_yields_old_then_new_events_and_never_half_a_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    stop = threading.Event()
    seen = follow(path, from_start=True, poll_s=0.01, stop=stop)  # the file does not exist yet
    with EventLog(path) as log:
        log.emit("requeue", None, reason="preempted")
        assert next(seen)["reason"] == "preempted"
        with open(path, "ab") as f:  # a writer caught mid-line
            f.write(b'{"kind": "engine_restarted", "step": "engine-1"')
            f.flush()
            tail = follow(path, from_start=False, poll_s=0.01, stop=stop)
            f.write(b', "recover_s": 4.5}\n')
        log.emit("router_relaunched", "router")
        assert next(seen) == {"kind": "engine_restarted", "step": "engine-1", "recover_s": 4.5}
        assert next(seen)["kind"] == "router_relaunched"
        # tail began mid-line: it skips that line's rest and everything before it.
        assert next(tail)["kind"] == "router_relaunched"
    stop.set()
    assert list(seen) == [] and list(tail) == []
