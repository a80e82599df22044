"""--eval-config: slime's eval YAML (examples/eval_multi_task/multi_task.yaml) gives the eval sets,
each field from the set, the defaults, then the flags, as slime's eval_config.py resolves them;
slime's set fields slurmrl lacks are refused with their reason. (Main refused --eval-config.)"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from rollout.eval_sets import EvalConfigError, eval_sets
from rollout.sample import Sample

# slime's examples/eval_multi_task/multi_task.yaml (tests/slime_examples/), its paths this machine's
MULTI_TASK = Path(__file__).resolve().parents[1] / "slime_examples" / "eval_multi_task" / "multi_task.yaml"


def _args(config: Path, **kw) -> Namespace:
    flags = dict(eval_config=str(config), eval_prompt_data=None, eval_input_key=None, input_key="prompt",
                 eval_label_key=None, label_key="label", metadata_key="metadata", tool_key="tools",
                 n_samples_per_eval_prompt=1, eval_temperature=None, rollout_temperature=1.0, eval_top_p=None,
                 rollout_top_p=1.0, eval_top_k=None, rollout_top_k=-1, eval_max_response_len=None,
                 rollout_max_response_len=8192, rollout_stop=None, rollout_stop_token_ids=None,
                 apply_chat_template=True, apply_chat_template_kwargs={})
    return Namespace(**{**flags, **kw})


def _files(root: Path) -> Path:
    for path in ("aime-2024/aime-2024.jsonl", "gpqa/gpqa_eval.jsonl", "ifbench/IFBench_eval.jsonl"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text('{"prompt": "q", "label": "a"}\n')
    config = root / "multi_task.yaml"
    config.write_text(MULTI_TASK.read_text().replace("/root/", f"{root}/"))
    return config


def test_slimes_multi_task_config_gives_its_sets(tmp_path: Path) -> None:
    aime, gpqa, ifbench = eval_sets(_args(_files(tmp_path)))
    assert [(s.name, s.rm_type, s.n_samples_per_eval_prompt) for s in (aime, gpqa, ifbench)] == [
        ("aime", "deepscaler", 16), ("gpqa", "gpqa", 2), ("ifbench", "ifbench", 1)]
    # the defaults over the flags, the flags for the rest
    assert (aime.max_response_len, aime.top_p, aime.temperature, aime.input_key) == (16384, 0.7, 1.0, "prompt")
    sample = Sample(index=0, group_index=0, prompt="q", metadata={"rm_type": "math", "row": 3})
    gpqa.stamp(sample)
    assert sample.metadata == {"rm_type": "gpqa", "row": 3}  # the set's reward wins over the sample's


@pytest.mark.parametrize("extra, message", [
    ("      repetition_penalty: 1.1\n", "set ifbench: repetition_penalty: repetition_penalty is not a sampling"),
    ("      reward_modle: x\n", "set ifbench: unknown key 'reward_modle'"),
    ("      custom_rm_path: ${oc.env:RM}\n", "an OmegaConf interpolation, which slurmrl does not resolve"),
])
def test_what_slurmrl_lacks_is_refused_naming_the_set(tmp_path: Path, extra: str, message: str) -> None:
    config = _files(tmp_path)
    config.write_text(config.read_text() + extra)
    with pytest.raises(EvalConfigError, match=message.replace("$", r"\$").replace("{", r"\{")):
        eval_sets(_args(config))


def test_a_missing_set_file_and_both_kinds_of_sets_are_refused(tmp_path: Path) -> None:
    config = _files(tmp_path)
    (tmp_path / "gpqa/gpqa_eval.jsonl").unlink()
    with pytest.raises(EvalConfigError, match=r"set gpqa: .*gpqa_eval.jsonl: no such file"):
        eval_sets(_args(config))
    with pytest.raises(EvalConfigError, match="give the eval sets in --eval-config or as --eval-prompt-data, not both"):
        eval_sets(_args(config, eval_prompt_data=["x", "y"]))
