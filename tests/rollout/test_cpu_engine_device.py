"""The stand-in engine's device flags (SGLang's --device, --base-gpu-id, --mem-fraction-static) where
no GPU is needed: they parse and reach the engine, --device cpu is what it always was, and what the
engine cannot do is refused at start with one line naming the flag. On a GPU: tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.cpu_engine.args import parse_args
from rollout.cpu_engine.engine import load_engine
from rollout.cpu_engine.server import build_app
from rollout.launch import EngineLaunch, cpu_engine_command
from tests.rollout.cpu_engine_helpers import REPO, asgi_get, make_tiny_model

ENGINE_START_S = 120  # an engine process's start on a loaded 2-core machine, up to its first error


def _engine_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout.cpu_engine", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=ENGINE_START_S, env={**os.environ, **(env or {})})


def test_the_gpu_flags_parse_and_reach_the_engines_command_line() -> None:
    args = parse_args(["--model-path", "m", "--device", "cuda", "--base-gpu-id", "1", "--mem-fraction-static", "0.4"])
    assert (args.device, args.base_gpu_id, args.mem_fraction_static) == ("cuda", 1, 0.4)
    shown = args.public()  # what /server_info shows
    assert (shown["device"], shown["base_gpu_id"], shown["mem_fraction_static"]) == ("cuda", 1, 0.4)
    assert args.without_effect().keys().isdisjoint({"base_gpu_id", "mem_fraction_static"}), "they act on a GPU"
    default = parse_args(["--model-path", "m"])
    assert (default.device, default.base_gpu_id, default.mem_fraction_static) == ("cpu", 0, None)
    # on the CPU they change nothing: the engine says so at start
    on_cpu = parse_args(["--model-path", "m", "--mem-fraction-static", "0.8"])
    assert on_cpu.without_effect()["mem_fraction_static"] == 0.8
    # the launcher passes SGLang's --device on (a GPU stand-in's), and the engine parses its command line
    launch = EngineLaunch("m", "127.0.0.1", 30000, base_gpu_id=1, device="cuda",
                          sglang_args=["--mem-fraction-static", "0.4"])
    argv = cpu_engine_command(launch)[3:]
    assert argv[argv.index("--device") + 1] == "cuda"
    assert parse_args(argv) == args


def test_the_cpu_device_is_unchanged(tmp_path: Path) -> None:
    engine = load_engine(parse_args(["--model-path", str(make_tiny_model(tmp_path / "model"))]))
    assert engine.device.name == "cpu"
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    # a trainer on a GPU asks for nccl: a CPU engine joins over gloo and receives into host tensors
    assert engine.device.update_backend("nccl") == "gloo" and engine.device.receive_device("gloo").type == "cpu"
    info = json.loads(asgi_get(build_app(engine), "/server_info")[1])
    assert info["device"] == "cpu" and info["internal_states"][0]["memory_usage"] == {}


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "xpu"], "argument --device: invalid choice: 'xpu'"),
    (["--device", "cuda", "--tp-size", "2"], "--tp-size 2: the stand-in engine uses one GPU"),
    (["--device", "cuda", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--device cuda: the stand-in engine spans nodes (--nnodes 2) on CPU only"),
    (["--device", "cuda", "--disaggregation-mode", "prefill"], "--disaggregation-mode prefill) runs on CPU only"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1], got 1.5"),
    (["--base-gpu-id", "-1"], "--base-gpu-id must be 0 or more, got -1"),
])
def test_what_the_engine_cannot_do_is_refused_by_its_flags(argv: list[str], message: str) -> None:
    done = _engine_cli("--model-path", "m", *argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_cuda_where_torch_sees_no_gpu_fails_at_start_with_one_line(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too.
    done = _engine_cli("--model-path", str(model), "--device", "cuda", "--port", "1", env={"CUDA_VISIBLE_DEVICES": ""})
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 1 and errors == [
        "cpu_engine: error: --device cuda: torch sees no CUDA device here (CUDA_VISIBLE_DEVICES=); run the engine "
        "where SLURM binds it a GPU (--rollout-engine standin), or give --device cpu"], done.stderr
    assert "fired up" not in done.stdout
