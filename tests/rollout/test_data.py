"""The jsonl and parquet data source: seeded order across epochs, exact resume, clear errors; the buffer
keeps unfinished groups through a state_dict round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.buffer import DataBuffer
from rollout.data import DataError, JsonlDataSource
from rollout.sample import Status


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return _write(tmp_path / "d.jsonl", [{"q": f"prompt {i}", "a": str(i), "m": {"k": i}} for i in range(7)])


def _source(path: Path, **kw) -> JsonlDataSource:
    return JsonlDataSource(path, input_key="q", label_key="a", metadata_key="m", n_samples_per_prompt=3, **kw)


def _ids(groups) -> list[tuple[int, str, int]]:
    return [(s.index, s.prompt, s.group_index) for g in groups for s in g]


def test_groups_epochs_and_seeded_order(data: Path) -> None:
    src = _source(data, seed=1)
    first = src.get_samples(7)
    assert [len(g) for g in first] == [3] * 7
    assert sorted(g[0].label for g in first) == [str(i) for i in range(7)]  # one epoch = every prompt once
    assert [g[0].group_index for g in first] == list(range(7))
    assert all(s.metadata["k"] == int(s.label) and s.metadata["epoch"] == 0 for g in first for s in g)
    second = src.get_samples(7)
    assert {g[0].metadata["epoch"] for g in second} == {1}
    assert [g[0].label for g in second] != [g[0].label for g in first]  # reshuffled per epoch
    assert _ids(_source(data, seed=1).get_samples(14)) == _ids(first + second)  # same seed, same order
    assert [g[0].label for g in _source(data, seed=2).get_samples(7)] != [g[0].label for g in first]


def test_resume_from_state_dict_yields_the_same_next_batches(data: Path) -> None:
    uninterrupted = _source(data)
    uninterrupted.get_samples(5)
    expected = _ids(uninterrupted.get_samples(4) + uninterrupted.get_samples(6))

    before = _source(data)
    before.get_samples(5)
    state = json.loads(json.dumps(before.state_dict()))  # survives serialisation
    resumed = _source(data)
    resumed.load_state_dict(state)
    assert _ids(resumed.get_samples(4) + resumed.get_samples(6)) == expected


def test_resume_with_other_data_or_seed_is_refused(data: Path, tmp_path: Path) -> None:
    state = _source(data).state_dict()
    with pytest.raises(DataError, match="resume with the same data and --seed"):
        _source(data, seed=7).load_state_dict(state)
    other = _write(tmp_path / "o.jsonl", [{"q": "x", "a": "1"}])
    with pytest.raises(DataError, match="resume with the same data"):
        _source(other).load_state_dict(state)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"d.jsonl:2: not valid JSON"),
    ('{"other": 1, "a": "1"}', r"d.jsonl:2: no 'q' field \(set --input-key"),
    ('{"q": "x"}', r"d.jsonl:2: no 'a' field \(check --label-key\)"),
    ('{"q": 5, "a": "1"}', r"d.jsonl:2: 'q' must be a string or a list"),
])
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "ok", "a": "1"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        JsonlDataSource(path, input_key="q", label_key="a")


def test_chat_template_gets_apply_chat_template_kwargs(tmp_path: Path) -> None:
    class Tokenizer:  # the one method the source calls; the real tokenizer is covered by engine tests
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            assert tokenize is False and add_generation_prompt is True
            think = "|think" if kwargs.get("enable_thinking", True) else ""
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:" + think

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    path = _write(tmp_path / "d.jsonl", [{"input": "plain"}, {"input": messages}])
    src = JsonlDataSource(path, tokenizer=Tokenizer(), apply_chat_template=True, shuffle=False)
    plain, chat = (g[0] for g in src.get_samples(2))
    assert plain.prompt == "user:plain|assistant:|think"
    assert chat.prompt == "user:hi|assistant:yo|user:again|assistant:|think"
    src = JsonlDataSource(path, tokenizer=Tokenizer(), apply_chat_template=True, shuffle=False,
                          apply_chat_template_kwargs={"enable_thinking": False})
    assert src.get_samples(1)[0][0].prompt == "user:plain|assistant:"
    with pytest.raises(DataError, match="--apply-chat-template and --rollout-max-prompt-len need the model's "):
        JsonlDataSource(path, apply_chat_template=True)


def test_long_prompts_are_dropped_and_tools_reach_the_chat_template(tmp_path: Path) -> None:
    """--rollout-max-prompt-len drops prompts longer than N tokens (chat template applied), as
    slime's filter_long_prompt does; a row's --tool-key field reaches apply_chat_template."""
    from transformers import AutoTokenizer

    from rollout.tiny_model import write_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path / "model"))
    rows = [{"input": "1 2"}, {"input": "1 2 3 4 5 6 7 8"}, {"input": "3", "tools": [{"name": "calc"}]}]
    path = _write(tmp_path / "d.jsonl", rows)
    lengths = [len(tokenizer(r["input"], add_special_tokens=False)["input_ids"]) for r in rows]
    limit = sorted(lengths)[1]
    src = JsonlDataSource(path, tokenizer=tokenizer, max_prompt_len=limit, shuffle=False)
    assert [g[0].prompt for g in src.get_samples(2)] == [r["input"] for r, n in zip(rows, lengths) if n <= limit]
    with pytest.raises(DataError, match="every prompt is longer than --rollout-max-prompt-len 0"):
        JsonlDataSource(path, tokenizer=tokenizer, max_prompt_len=0)

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None, **kwargs):
            return f"{messages[-1]['content']}|tools={tools}"

    src = JsonlDataSource(path, tokenizer=Tokenizer(), apply_chat_template=True, shuffle=False)
    assert [g[0].prompt for g in src.get_samples(3)][2] == "3|tools=[{'name': 'calc'}]"


def test_parquet_reads_as_jsonl_does(tmp_path: Path, data: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)  # several batches
    from_jsonl, from_parquet = _source(data), _source(tmp_path / "d.parquet")
    assert _ids(from_parquet.get_samples(9)) == _ids(from_jsonl.get_samples(9))
    assert from_parquet.rows == from_jsonl.rows
    # messages as a list of structs, metadata a struct
    messages = [{"role": "user", "content": "hi"}]
    pq.write_table(pa.Table.from_pylist([{"q": messages, "a": "1", "m": {"rm_type": "f1"}}]), tmp_path / "m.parquet")
    sample = _source(tmp_path / "m.parquet").get_samples(1)[0][0]
    assert sample.prompt == messages and sample.metadata["rm_type"] == "f1"
    pq.write_table(pa.Table.from_pylist([{"q": "x"}, {"q": "y"}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet row 1: no 'a' field \(check --label-key\)"):
        _source(tmp_path / "bad.parquet")


def test_other_suffixes_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.json", [{"input": "x"}])
    with pytest.raises(DataError, match=r"d.json: unsupported format; give a .jsonl or .parquet file"):
        JsonlDataSource(path)


def test_buffer_serves_unfinished_groups_first_and_survives_state_dict(data: Path) -> None:
    buffer = DataBuffer(_source(data))
    first = buffer.get(3)
    first[1][0].status, first[1][0].response = Status.ABORTED, "half a resp"
    buffer.add([first[1]])
    state = json.loads(json.dumps(buffer.state_dict()))
    restored = DataBuffer(_source(data))
    restored.load_state_dict(state)
    for b in (buffer, restored):
        nxt = b.get(2)
        assert nxt[0][0].index == first[1][0].index and nxt[0][0].response == "half a resp"
        assert nxt[0][0].status is Status.ABORTED
        assert nxt[1][0].index == 9  # fresh prompts continue after the 3 groups of 3 already handed out
