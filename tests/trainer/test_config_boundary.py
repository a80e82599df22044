"""No function outside argument parsing, the config builder and the CLIs' own argparse handlers
takes an argparse Namespace: components get their TrainerConfig section (trainer.config), and
slime's plug-ins get slime's Namespace from TrainerConfig.plugin_namespace() alone."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from rollout.tiny_model import write_tiny_model
from trainer.args_parser import RefusedFlag, build_parser
from trainer.config import build_config
from trainer.config.trainer_config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "rollout", "supervisor", "ckpt_tools", "contract", "slurm")

# Where a Namespace may be taken, each with why: (module path, function name or "*" for every one).
ALLOWED = {
    ("trainer/args_actions.py", "__call__"): "argparse's Action protocol: the refused-flag action runs inside parsing",
    ("trainer/config/build.py", "*"): "the config builder: reads the parsed flags once, into TrainerConfig",
    ("trainer/config/model_checks.py", "*"): "the config builder's checks against the HF config",
    ("trainer/custom_config.py", "*"): "argument parsing: --custom-config-path's keys set on the parsed flags",
    ("trainer/config/plugin_checks.py", "*"): "the config builder's checks of slime's plug-in and SFT flags",
    ("trainer/config/async_checks.py", "*"): "the config builder's checks of the asynchronous flags",
    ("supervisor/profile_cli.py", "run"): "`slurmrl profile`'s own CLI handler (it parses its own flags)",
    ("supervisor/report.py", "run"): "`slurmrl report`'s own CLI handler (it parses its own flags)",
    ("rollout/trace_view.py", "main"): "`python -m rollout.trace_view`'s own CLI handler",
}
# A package's command line parses its own flags: its handlers take them.
CLI_MODULES = ("cli.py", "__main__.py")


def _takes_namespace(arg: ast.arg) -> bool:
    if arg.annotation is None:
        return arg.arg == "args"
    return "Namespace" in ast.unparse(arg.annotation)


def _offenders() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            if path.name in CLI_MODULES:
                continue
            for node in ast.walk(ast.parse(path.read_text(), module)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if (module, node.name) in ALLOWED or (module, "*") in ALLOWED:
                    continue
                params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [f"{module}:{node.lineno} {node.name}({p.arg})" for p in params if _takes_namespace(p)]
    return found


def test_no_component_takes_an_argparse_namespace() -> None:
    assert _offenders() == [], "take a TrainerConfig section instead (trainer/config/sections.py)"


def test_every_allowed_place_still_exists() -> None:
    """A stale allow-list entry would hide a new offender at the same name."""
    for module, function in ALLOWED:
        text = (ROOT / module).read_text()
        assert function == "*" or f"def {function}(" in text, (module, function)


def test_every_flag_has_one_home_in_the_config() -> None:
    """Each flag slurmrl implements is a field of exactly one section; the others are slime's
    refused flags (TrainerConfig.plugin_only), kept only for the plug-in Namespace."""
    owners: dict[str, list[str]] = {}
    for section in SECTIONS:
        for field in dataclasses.fields(section):
            owners.setdefault(field.name, []).append(section.__name__)
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}
    flags = [a for a in build_parser()._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert [a.dest for a in flags if a.dest not in owners and not isinstance(a, RefusedFlag)] == []


def test_plugins_get_every_flag_by_slimes_name(tmp_path: Path) -> None:
    """The plug-in Namespace holds every parsed flag and the derived values the trainer's
    Namespace held before TrainerConfig (plug-ins read e.g. args.sglang_router_ip, args.eval_datasets)."""
    model = write_tiny_model(tmp_path / "model")
    config = build_config(build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
        "--load-debug-rollout-data", "x", "--attention-backend", "flash", "--hidden-dropout", "0.0"]))
    plugin_args = config.plugin_namespace()
    dests = {a.dest for a in build_parser()._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}
    assert set(vars(plugin_args)) == dests | {"attention_kernels", "ref_model_needed", "eval_datasets", "api_key",
                                             "model_files"}
    assert (plugin_args.attention_backend, plugin_args.attention_kernels) == ("sdpa", "flash")
    assert plugin_args.hidden_dropout == 0.0 and plugin_args.global_batch_size == 32 * 2
    assert plugin_args.hf_checkpoint == config.model.hf_checkpoint


def test_the_config_is_built_once_and_the_parse_is_left_as_it_was(tmp_path: Path) -> None:
    """Derived values live in the config's fields; the parsed Namespace is read, never written,
    and the config cannot be changed after it is built."""
    model = write_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "x"}\n')
    parsed = build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "2", "--n-samples-per-prompt", "2", "--engine-urls", "u",
        "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout", "--prompt-data", str(prompts),
        "--attention-backend", "unfused", "--use-kl-loss"])
    before = dict(vars(parsed))
    config = build_config(parsed)
    assert vars(parsed) == before
    assert config.rollout.rollout_function_path is None  # slime's default: the built-in rollout
    assert (config.model.attention_backend, config.model.attention_kernels) == ("local", "unfused")
    assert config.loss.ref_model_needed and config.batching.global_batch_size == 32 * 2
    assert config.optimizer.lr_decay_iters == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.loss.kl_coef = 1.0  # type: ignore[misc]


def test_plugins_get_slimes_eval_max_context_len(tmp_path: Path) -> None:
    """slime's own eval reads --eval-max-context-len nowhere; plug-ins do (multi_agent bounds its
    eval prompts by it), with --rollout-max-context-len as its default."""
    model = write_tiny_model(tmp_path / "model")
    base = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
            "--load-debug-rollout-data", "x", "--rollout-max-context-len", "64"]
    assert build_config(build_parser().parse_args(base)).plugin_namespace().eval_max_context_len == 64
    given = build_config(build_parser().parse_args([*base, "--eval-max-context-len", "32"]))
    assert given.plugin_namespace().eval_max_context_len == 32
