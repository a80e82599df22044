"""--custom-config-path: slime's YAML of custom functions' arguments, each key set on args after the
flags. A trainer flag's key changes that flag (mis.yaml's use_tis turns TIS on), the others reach
the plug-ins on args; a refused flag or a value of the wrong kind is refused, naming the file and
the key. (Before: "unknown flag --custom-config-path".)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.tiny_model import write_tiny_model
from trainer.args import ArgsError, parse_args


def _argv(model: Path, config: Path) -> list[str]:
    return ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
            "--load-debug-rollout-data", "x", "--tis-clip", "3.0", "--custom-config-path", str(config)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_its_keys_set_flags_and_reach_the_plugins(model: Path, tmp_path: Path) -> None:
    config = tmp_path / "mis.yaml"
    config.write_text("use_tis: true\ntis_clip: 2\ntis_mode: truncate\nrs_veto_threshold: 1.0e-4\n"
                      "rs_lower_bound: null\n")
    trainer = parse_args(_argv(model, config))
    assert trainer.loss.use_tis and trainer.loss.tis_clip == 2.0  # the YAML wins over the flag, as in slime
    assert isinstance(trainer.loss.tis_clip, float)
    args = trainer.plugin_namespace()
    assert (args.use_tis, args.tis_mode, args.rs_veto_threshold, args.rs_lower_bound) == (True, "truncate", 1e-4, None)
    assert args.custom_config_path == str(config)


@pytest.mark.parametrize("text, message", [
    ("update_weight_mode: delta\n", "update_weight_mode: weights are published in full each version"),
    ("lr: 1e-6\n", "lr: '1e-6' is not a value of --lr"),  # YAML reads 1e-6 as a string
    ("use_tis: 1\n", "use_tis: 1 is not a value of --use-tis"),
    ("advantage_estimator: nope\n", "advantage_estimator: 'nope' is not a value of --advantage-estimator"),
    ("- a list\n", "must hold a mapping of argument: value"),
])
def test_a_bad_key_is_refused_naming_the_file(model: Path, tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ArgsError, match=f"--custom-config-path {config}: .*{message}"):
        parse_args(_argv(model, config))


def test_a_missing_file_is_refused(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ArgsError, match="no such file"):
        parse_args(_argv(model, tmp_path / "nope.yaml"))
