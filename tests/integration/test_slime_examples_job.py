"""slime's examples as jobs on the devcluster (issue 33, item 5): their plug-in code, copied unchanged
into tests/slime_examples/, loaded by the trainers of real jobs (the supervisor, the real router,
a CPU engine each) from the flags of their run scripts, with this machine's paths and the tiny
model's sizes:

- retool (retool_qwen3_4b_rl.sh): generate_with_retool.generate and reward_func train the job
  (--reward-key score); its SFT stage (retool_qwen3_4b_sft.sh: slime's SFT rollout over ReTool-SFT's
  conversations, --debug-train-only) is a third job, on one node and no engine, which SLURM starts
  once the other two leave it room;
- train_infer_mismatch_helper (run-qwen3-4b-mis.sh): mis.yaml as --custom-config-path and mis.py's
  compute_mis_weights_with_cp as --custom-tis-function-path weigh the same job's policy loss;
- eval_multi_task (multi_task.sh), the second job: multi_task.yaml as --eval-config, its aime, gpqa
  and ifbench sets (IFBench's evaluation_lib stood in for) evaluated before training;
- search-r1 and multi_agent (run-qwen3-30B-A3B-multi-agent.sh's, which returns list[Sample]): a job
  has one training generate function, so theirs and their rewards run as two more sets of that eval
  config (a set may name its own, as slime's eval config allows).

The engines serve the random tiny model, which never calls a tool or answers, so every reward is what
slime's code gives such a response: retool's is -1.1 (math_dapo's -1, less its bonus for tool calls
under two). Each example's own logic, with scripted engines that do call tools, is
tests/rollout/test_slime_examples.py; this test shows they run as a slime user submits them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow
import pyarrow.parquet
import yaml

from contract.spec_loading import spec_from_yaml
from tests.integration.test_rl_job import events, slurmrl, status
from tests.slurm_helpers import wait_job_gone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "slime_examples"
IMPORTED = [EXAMPLES / "retool", EXAMPLES / "search_r1", ROOT / "tests" / "rollout" / "ifbench_standin"]
MULTI_AGENT = "tests.slime_examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"
ROLLOUTS = 2
JOB_S = 600  # submission to the end of a 2-rollout job (or a 1-rollout one, its eval first)
RETOOL_NO_TOOL_WRONG = -1.1  # reward_func: min(-0.6, -1 + (0 tool calls - 2) / 2 * 0.1)
SEARCH_PROMPT = ("Answer the given question. You can call a search engine by <search> query </search>. Answer "
                 "inside <answer> and </answer>. Question: What is the capital of {}?")

# retool_qwen3_4b_sft.sh's SFT, perf, optimizer and misc flags: --num-epoch 3 over two conversations,
# two a rollout, so three rollouts; no engines (--debug-train-only), no advantages.
SFT_ARGS = ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--input-key", "messages",
            "--rollout-shuffle", "--num-epoch", "3", "--rollout-batch-size", "2", "--global-batch-size", "2",
            "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
            "--debug-train-only"]
PERF_ARGS = ["--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
             "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"]
OPTIMIZER_ARGS = ["--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
                  "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95"]
# (slime's --attention-backend flash needs a GPU; this trainer runs on CPU)
MISC_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
             "--attention-softmax-in-fp32"]


def _conversations(path: Path) -> Path:
    """ReTool-SFT's shape (sft_data_processing.py: a "messages" column), two conversations."""
    messages = [[{"role": "user", "content": f"What is {a} times 7?"},
                 {"role": "assistant", "content": f"<code>print({a} * 7)</code>\n<interpreter>{a * 7}</interpreter>\n"
                                                  f"Answer: \\boxed{{{a * 7}}}"}] for a in (6, 8)]
    pyarrow.parquet.write_table(pyarrow.table({"messages": messages}), path)
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _eval_config(root: Path) -> Path:
    """multi_task.yaml with this machine's paths and the tiny model's sizes, and the search-r1 and
    multi_agent sets."""
    text = (EXAMPLES / "eval_multi_task" / "multi_task.yaml").read_text().replace("/root/", f"{root}/")
    config = yaml.safe_load(text)
    config["eval"]["defaults"]["max_response_len"] = 4
    for dataset in config["eval"]["datasets"]:
        dataset["n_samples_per_eval_prompt"] = min(dataset["n_samples_per_eval_prompt"], 2)
    _jsonl(root / "aime-2024/aime-2024.jsonl", [{"prompt": "1 + 1?", "label": "2"}])
    _jsonl(root / "gpqa/gpqa_eval.jsonl", [{"prompt": "Pick A.", "label": "A",
                                           "metadata": {"choices": ["x", "y"], "correct_letter": "A"}}])
    _jsonl(root / "ifbench/IFBench_eval.jsonl", [{"prompt": "End with done.", "label": "", "metadata": {
        "instruction_id_list": ["ends_with"], "kwargs": [{"end": "done."}], "prompt_text": "End."}}])
    config["eval"]["datasets"] += [
        {"name": "search_r1", "path": str(_jsonl(root / "nq.jsonl", [
            {"prompt": _chat(SEARCH_PROMPT.format("France")),
             "reward_model": {"ground_truth": {"target": ["Paris"]}}}])),
         "input_key": "prompt", "label_key": "reward_model", "apply_chat_template": True,
         "custom_generate_function_path": "generate_with_search.generate",
         "custom_rm_path": "generate_with_search.reward_func"},
        {"name": "multi_agent", "path": str(_jsonl(root / "sum.jsonl", [{"prompt": _chat("What is 2 + 2?"),
                                                                           "label": "4"}])),
         "input_key": "prompt", "label_key": "label", "apply_chat_template": True, "rm_type": "deepscaler",
         "n_samples_per_eval_prompt": 1,
         "custom_generate_function_path": MULTI_AGENT}]
    path = root / "multi_task.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _submit(toy: tuple[Path, Path], job_dir: Path, *flags: str) -> str:
    """A one-engine toy job (two fit the devcluster's four nodes at once) with the examples' imports."""
    model, data = toy
    done = slurmrl("submit", "examples/toy_job.yaml", "--json", "--job-dir", str(job_dir), "--hf-checkpoint",
                   str(model), "--prompt-data", str(data), "--rollout-num-engines", "1", "--rollout-batch-size", "2",
                   "--n-samples-per-prompt", "2", "--trainer-setup",
                   f"export PYTHONPATH={':'.join(map(str, IMPORTED))}:$PYTHONPATH", *flags)
    return json.loads(done.stdout.strip().splitlines()[-1])["job_id"]


def _completed(job_id: str, job_dir: Path) -> list[dict]:
    wait_job_gone(job_id, timeout_s=JOB_S)
    state = status(job_dir)
    assert state["stop_reason"] == "completed", (state, events(job_dir, "trainer_failed"))
    assert not events(job_dir, "plugin_error") and not events(job_dir, "trainer_failed")
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def test_slimes_examples_run_as_devcluster_jobs(devcluster, toy, tmp_path: Path) -> None:
    """Three jobs, submitted at once (the third waits for room): retool's RL is not the eval job
    because its rewards are dicts (--reward-key score), which slime's eval also applies to every
    eval set (--eval-reward-key defaults to it), whose rewards are numbers."""
    dapo = _jsonl(tmp_path / "dapo.jsonl", [{"prompt": _chat(f"What is 6 times {b}?"), "label": str(6 * b)}
                                            for b in range(2, 6)])
    retool = _submit(
        toy, tmp_path / "retool", "--prompt-data", str(dapo), "--num-rollout", str(ROLLOUTS),
        "--rollout-max-response-len", "8", "--rollout-max-context-len", "1000",
        # retool_qwen3_4b_rl.sh
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--reward-key", "score",
        "--custom-generate-function-path", "generate_with_retool.generate",
        "--custom-rm-path", "generate_with_retool.reward_func",
        # run-qwen3-4b-mis.sh
        "--custom-config-path", str(EXAMPLES / "train_infer_mismatch_helper" / "mis.yaml"),
        "--custom-tis-function-path",
        "tests.slime_examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp")
    # multi_task.sh, on the toy job's own training: its eval sets' prompt and label keys
    evals = _submit(toy, tmp_path / "evals", "--num-rollout", "1", "--rollout-max-context-len", "1000",
                    "--eval-input-key", "prompt", "--eval-label-key", "label",
                    "--eval-config", str(_eval_config(tmp_path / "eval")), "--eval-interval", "100")
    # retool_qwen3_4b_sft.sh, from flags alone: no job YAML, so none of the toy job's RL flags
    sft_dir = tmp_path / "sft"
    sft = json.loads(slurmrl(
        "submit", "--json", "--job-name", "retool-sft", "--partition", "dev", "--time", "00:30:00",
        "--job-dir", str(sft_dir), "--actor-num-gpus-per-node", "0", "--actor-num-cpu-workers", "1",
        "--actor-cpus-per-task", "2", "--hf-checkpoint", str(toy[0]),
        "--prompt-data", str(_conversations(tmp_path / "ReTool-SFT.parquet")), "--save", str(sft_dir / "ckpt"),
        "--save-interval", "1000", *SFT_ARGS, *PERF_ARGS, *OPTIMIZER_ARGS, *MISC_ARGS,
    ).stdout.splitlines()[-1])["job_id"]
    rows = _completed(retool, tmp_path / "retool")
    assert [r["rollout_id"] for r in rows] == list(range(ROLLOUTS))
    assert all(r["reward_mean"] == RETOOL_NO_TOOL_WRONG for r in rows), [r["reward_mean"] for r in rows]
    assert any("mis_" in key for key in rows[0]), sorted(rows[0])  # mis.py's metrics
    [first] = _completed(evals, tmp_path / "evals")
    sets = {key.split("/")[-1] for key in first if key.startswith("before_train/eval/") and "-" not in key}
    assert sets == {"aime", "gpqa", "ifbench", "search_r1", "multi_agent"}, sorted(first)
    assert all(0.0 <= first[f"before_train/eval/{name}"] <= 1.2 for name in sets)
    rows = _completed(sft, sft_dir)
    assert [r["samples"] for r in rows] == [2, 2, 2]  # --num-epoch 3 over two conversations, two a rollout
    losses = [r["sft_loss"] for r in rows]
    assert losses[0] > losses[1] > losses[2], losses
    assert not spec_from_yaml(sft_dir / "spec.yaml").starts_engines, "--debug-train-only: no engines"
    assert (sft_dir / "ckpt/latest_checkpointed_iteration.txt").read_text().strip() == "2", "the final save"
