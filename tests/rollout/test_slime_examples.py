"""slime's examples, their plug-in code copied unchanged (tests/slime_examples/, each file says from
where), run against stand-ins, with the flags of their run scripts (model sizes, batch sizes and
paths this machine's): each rollout runs to its end and its rewards are what slime's code gives.

- search-r1: generate_with_search.generate and reward_func; a local retrieval server stands in for
  Search-R1's, the engine's replies are scripted (search, then answer) since a random tiny model
  never searches.
- retool: generate_with_retool.generate (a tool call run in its own tool_sandbox, then the answer)
  and reward_func (math_dapo's strict box, --reward-key score).
- multi_agent: rollout_with_multi_agents.generate_with_multi_agents, which returns list[Sample]
  (5 solvers, 5 rewriters, a selector), scored by slime's batched_async_rm (deepscaler).
- eval_multi_task: multi_task.yaml as --eval-config over CPU engines behind the real router:
  deepscaler, gpqa and ifbench (IFBench's evaluation_lib stood in for) scored per set.
- train_infer_mismatch_helper: mis.yaml as --custom-config-path and mis.py's
  compute_mis_weights_with_cp as --custom-tis-function-path reweight and mask the policy loss.
Before, each failed at its first slime import (GenerateState, append_response_tokens, rm_hub,
load_function, cp_utils) or at its flags (--custom-config-path, --eval-config, --custom-tis-...)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.eval import Evaluator
from rollout.generate import generate_rollout
from rollout.sample import Sample, Status
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.misc import SingletonMeta
from tests.rollout.example_standins import RetrievalServer, ScriptedEngine, serving
from tests.rollout.servers import API_KEY
from trainer.args import parse_args
from trainer.batch import TrainSample
from trainer.config import TrainerConfig
from trainer.config.rollout_args import rollout_args
from trainer.loop_builder import train_plugins
from trainer.rl_step import loss_config
from trainer.slime_loss import make_slime_pack_loss

EXAMPLES = Path(__file__).resolve().parents[1] / "slime_examples"
ROUTER_TIMEOUT_S = 10.0


@pytest.fixture(autouse=True)
def fresh_generate_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """slime's GenerateState is one per process, built from the first args: each example its own."""
    from contract.job_dir import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    SingletonMeta.clear_instances(GenerateState)
    yield
    SingletonMeta.clear_instances(GenerateState)


def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(model: Path, data: Path, url: str, *flags: str) -> TrainerConfig:
    host, port = url.removeprefix("http://").split(":")
    return parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", "1",
                       "--sglang-router-ip", host, "--sglang-router-port", port, *flags])


def _rollout(config: TrainerConfig, url: str, model: Path) -> list[Sample]:
    ro = config.rollout
    buffer = DataBuffer(JsonlDataSource(ro.prompt_data or "", input_key=ro.input_key, label_key=ro.label_key,
                                        tokenizer=_tokenizer(model), apply_chat_template=ro.apply_chat_template,
                                        shuffle=False, n_samples_per_prompt=ro.n_samples_per_prompt))
    groups = generate_rollout(rollout_args(config, url, ROUTER_TIMEOUT_S, None), 0, buffer)
    return [s for group in groups for s in group]


# ---- search-r1 ---------------------------------------------------------------------------------------
SEARCH_PROMPT = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
                 "you get new information. After reasoning, if you find you lack some knowledge, you can call a "
                 "search engine by <search> query </search> and it will return the top searched results between "
                 "<information> and </information>. If you find no further external knowledge needed, you can "
                 "directly provide the answer inside <answer> and </answer>, without detailed illustrations. For "
                 "example, <answer> Beijing </answer>. Question: What is the capital of {country}?")


def _searcher(text: str) -> str:
    """Searches first; answers from what it found (Paris wherever it found anything)."""
    if "<information>Doc" not in text:  # (the prompt itself names the tags)
        country = re.findall(r"capital of (\w+)\?", text)[-1]
        return f"<think>I need to search.</think>\n<search>capital of {country}</search>"
    return "<think>Found it.</think>\n<answer>Paris</answer>"


def test_search_r1(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "search_r1"))
    import generate_with_search

    data = _jsonl(tmp_path / "nq.jsonl", [
        {"prompt": [{"role": "user", "content": SEARCH_PROMPT.format(country=c)}],
         "reward_model": {"ground_truth": {"target": [capital]}}} for c, capital in (("France", "Paris"),
                                                                                    ("Italy", "Rome"))])
    documents = {"France": '"France"\nParis is the capital of France.', "Italy": '"Italy"\nRome is the capital.'}
    with serving(ScriptedEngine(_tokenizer(model), _searcher)) as engine, \
            serving(RetrievalServer(documents)) as retrieval:
        monkeypatch.setitem(generate_with_search.SEARCH_R1_CONFIGS["local"], "search_url", f"{retrieval.url}/retrieve")
        # run_qwen2.5_3B.sh's ROLLOUT_ARGS and CUSTOM_ARGS
        config = _config(model, data, engine.url, "--input-key", "prompt", "--label-key", "reward_model",
                         "--apply-chat-template", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--rollout-max-response-len", "512", "--rollout-temperature", "1",
                         "--custom-generate-function-path", "generate_with_search.generate",
                         "--custom-rm-path", "generate_with_search.reward_func")
        samples = _rollout(config, engine.url, model)
    assert sorted(retrieval.queries) == ["capital of France"] * 2 + ["capital of Italy"] * 2, [s.response for s in samples]
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]  # Paris is right for France only (exact match)
    for s in samples:
        assert s.status is Status.COMPLETED and s.response.endswith("<answer>Paris</answer>")
        assert "<information>" in s.response and len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)
        assert 0 < sum(s.loss_mask) < s.response_length  # the retrieved passage is not trained on
        TrainSample.from_sample(s)


# ---- retool -------------------------------------------------------------------------------------------
def _coder(text: str) -> str:
    """Calls the code interpreter first; answers with the last line it printed."""
    printed = re.findall(r"<interpreter>\n(.*?)\n</interpreter>", text, re.DOTALL)
    if not printed:
        return '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    return f"So the answer is computed.\nAnswer: \\boxed{{{printed[-1].strip().splitlines()[-1]}}}"


def test_retool(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "retool"))
    data = _jsonl(tmp_path / "dapo.jsonl", [{"prompt": [{"role": "user", "content": "What is 6 times 7?"}],
                                             "label": label} for label in ("42", "41")])
    with serving(ScriptedEngine(_tokenizer(model), _coder)) as engine:
        # retool_qwen3_4b_rl.sh's ROLLOUT_ARGS, PERF_ARGS' token budget and CUSTOM_ARGS
        config = _config(model, data, engine.url, "--input-key", "prompt", "--label-key", "label",
                         "--apply-chat-template", "--reward-key", "score", "--rollout-batch-size", "2",
                         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8192",
                         "--rollout-temperature", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
                         "--custom-generate-function-path", "generate_with_retool.generate",
                         "--custom-rm-path", "generate_with_retool.reward_func")
        samples = _rollout(config, engine.url, model)
    # math_dapo's strict box: 42 matches the first label only; a wrong answer after one tool call gets
    # reward_func's tool bonus, -1 + (1 - 2) / 2 * 0.1
    assert [s.reward["score"] for s in samples] == [1.0, 1.0, -1.05, -1.05], [(s.response, s.reward) for s in samples]
    assert [s.reward["pred"] for s in samples] == ["42"] * 4
    for s in samples:
        assert s.tool_call_count == 1 and "<interpreter>\nOutput:\n42\n</interpreter>" in s.response
        assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) and 0 < sum(s.loss_mask)
        assert TrainSample.from_sample(s, "score").reward == s.reward["score"]


# ---- multi_agent --------------------------------------------------------------------------------------
def _agents(text: str) -> str:
    """Solvers and rewriters answer 4; the selector picks the first rewritten solution."""
    if "Candidate Solutions" in text or "systematically analyze" in text:
        return "I compared them.</think> Judgment: 1"
    return "Let me think.</think> The sum is \\boxed{4}"


def test_multi_agent(model: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "dapo.jsonl", [{"prompt": [{"role": "user", "content": f"What is 2 + {b}?"}],
                                             "label": label} for b, label in ((2, "4"), (3, "5"))])
    with serving(ScriptedEngine(_tokenizer(model), _agents)) as engine:
        # run-qwen3-30B-A3B-multi-agent.sh's ROLLOUT_ARGS
        config = _config(model, data, engine.url, "--custom-generate-function-path",
                         "tests.slime_examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents",
                         "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type",
                         "deepscaler", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--rollout-max-context-len", "16384", "--rollout-max-response-len", "8192",
                         "--rollout-temperature", "1")
        groups: dict[int, list[Sample]] = {}
        for s in _rollout(config, engine.url, model):
            groups.setdefault(s.group_index, []).append(s)
    # each call, eleven samples (5 solvers, 5 rewriters and the selector), all of its prompt's group
    assert sorted(len(g) for g in groups.values()) == [22, 22]
    right, wrong = groups[0], groups[1]
    assert [s.reward for s in right] == [1.2] * 22  # correct: every reward x 1.2 (slime's correct_reward_weight)
    assert [s.reward for s in wrong] == [0.0] * 22  # 4 is wrong for 2 + 3: 0 x 0.8
    assert sorted({s.rollout_id for s in right}) == [0, 1]  # run_agent_system's rollout id: its argument's index
    for s in right + wrong:
        assert s.status is Status.COMPLETED and len(s.rollout_log_probs) == s.response_length
        TrainSample.from_sample(s)


# ---- eval_multi_task ----------------------------------------------------------------------------------
def _multi_task_yaml(root: Path) -> Path:
    """multi_task.yaml with this machine's paths and the tiny model's response length and sample counts."""
    text = (EXAMPLES / "eval_multi_task" / "multi_task.yaml").read_text()
    text = text.replace("/root/", f"{root}/").replace("max_response_len: 16384", "max_response_len: 4")
    text = text.replace("n_samples_per_eval_prompt: 16", "n_samples_per_eval_prompt: 2")
    rows = {"aime-2024/aime-2024.jsonl": {"prompt": "1 + 1?", "label": "2"},
            "gpqa/gpqa_eval.jsonl": {"prompt": "Pick A.", "label": "A",
                                     "metadata": {"choices": ["x", "y"], "correct_letter": "A"}},
            "ifbench/IFBench_eval.jsonl": {"prompt": "End with done.", "label": "",
                                           "metadata": {"instruction_id_list": ["ends_with"],
                                                        "kwargs": [{"end": "done."}], "prompt_text": "End."}}}
    for path, row in rows.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        _jsonl(root / path, [row])
    config = root / "multi_task.yaml"
    config.write_text(text)
    return config


def test_eval_multi_task(cluster, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "ifbench_standin"))
    monkeypatch.delitem(sys.modules, "evaluation_lib", raising=False)
    router, _ = cluster
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1 + 1?", "label": "2"}])
    # multi_task.sh's ROLLOUT_ARGS and EVAL_ARGS
    config = _config(model, data, router.url, "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
                     "--rm-type", "deepscaler", "--eval-interval", "20", "--eval-config",
                     str(_multi_task_yaml(tmp_path)), "--n-samples-per-prompt", "2")
    rollout = rollout_args(config, router.url, ROUTER_TIMEOUT_S, None)
    metrics = Evaluator(rollout, config.eval.eval_datasets, rollout.for_plugins, tokenizer=_tokenizer(model)).run(
        0, None)
    assert {k for k in metrics if k.count("/") == 1 and "-" not in k} == {"eval/aime", "eval/gpqa", "eval/ifbench"}
    assert metrics["eval/aime-truncated_ratio"] == 1.0  # 4 tokens answer nothing: slime's rewards, all 0
    assert all(0.0 <= metrics[f"eval/{name}"] <= 1.0 for name in ("aime", "gpqa", "ifbench"))
    assert "eval/aime-pass@2" in metrics and "eval/ifbench-pass@1" not in metrics  # ifbench: one sample


# ---- train_infer_mismatch_helper ---------------------------------------------------------------------
def test_train_infer_mismatch_helper(model: Path, tmp_path: Path) -> None:
    """run-qwen3-4b-mis.sh's CUSTOM_ARGS: mis.yaml turns TIS and rejection sampling on; mis.py's
    weights multiply the policy loss and its masks drop the tokens whose ratio is out of bounds."""
    from tests.slime_examples.train_infer_mismatch_helper import mis

    data = _jsonl(tmp_path / "d.jsonl", [{"input": "x"}])
    config = _config(model, data, "http://127.0.0.1:1", "--n-samples-per-prompt", "2", "--custom-config-path",
                     str(EXAMPLES / "train_infer_mismatch_helper" / "mis.yaml"), "--custom-tis-function-path",
                     "tests.slime_examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp")
    assert config.loss.use_tis  # from mis.yaml
    plugins = train_plugins(config)
    ratios = ([1.0, 1.5, 3.0], [0.9, 0.1])  # 3.0 and 0.1 are out of mis.yaml's rejection bounds [0.5, 2]
    samples = [TrainSample(tokens=torch.arange(len(r) + 2), response_length=len(r), loss_mask=torch.ones(len(r)),
                           reward=0.0, group_index=0, old_log_probs=torch.log(torch.tensor(r)),
                           rollout_log_probs=torch.zeros(len(r)), advantages=torch.ones(len(r))) for r in ratios]
    logps = [s.old_log_probs.clone().requires_grad_() for s in samples]
    pack_loss = make_slime_pack_loss(loss_config(config.loss), plugins.loss, samples, [0, 1])
    value, metrics = pack_loss(type("Pack", (), {"sample_ids": [0, 1]})(), logps, None)
    # slime's own function on the same values: weights truncated at 2, batch-normalized; masks rejecting 3.0, 0.1
    weights, masks, _ = mis.compute_mis_weights(plugins.args, train_log_probs=[s.old_log_probs for s in samples],
                                                rollout_log_probs=[s.rollout_log_probs for s in samples],
                                                loss_masks=[s.loss_mask for s in samples])
    assert [m.tolist() for m in masks] == [[1.0, 1.0, 0.0], [1.0, 0.0]]
    expected = sum(float((-w * m).sum()) / len(m) for w, m in zip(weights, masks)) / 2  # ratio 1 on policy: -A
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5)
    assert {"mis_batch_norm_factor", "mis_chi2_seq", "ois"} <= metrics.keys()  # mis.py's metrics, prefixed as slime's
    assert any(key.startswith("mis_rs_") for key in metrics)
