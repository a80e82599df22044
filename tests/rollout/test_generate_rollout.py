"""generate_rollout against two real CPU engines behind the real sglang-router: a round of 32
prompts x 4 samples completes; with one engine SIGKILLed mid-round it still returns all 128
samples, each exactly once, each with its weight version, and the requests sent again are counted.

The tests that leave their engines serving share one pair (`engines`, made once for the module:
starting a pair takes longer than a round); the one that kills an engine has a pair of its own."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from contract.job_dir import API_KEY_ENV
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout
from rollout.router_client import RouterClient
from rollout.sample import Status
from slurm.devcluster.daemons import wait_for
from tests.rollout.servers import API_KEY, Server, engines_behind_router

PROMPTS, N = 32, 4


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory) -> Iterator[tuple[RouterClient, list[Server]]]:
    """Two engines behind a router, shared by the tests that leave them serving."""
    with engines_behind_router(model, tmp_path_factory.mktemp("engines")) as pair:
        yield pair


def _args(model: Path, router: RouterClient) -> RolloutArgs:
    return RolloutArgs(hf_checkpoint=str(model), router_url=router.url, api_key=API_KEY, rollout_batch_size=PROMPTS,
                       n_samples_per_prompt=N, rollout_max_response_len=8, rm_type="toy")


def _buffer(tmp_path: Path) -> DataBuffer:
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"input": f"repeat: {i % 10}", "label": str(i % 10)}) + "\n"
                            for i in range(PROMPTS)))
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=N, seed=3))


def _check_complete(groups) -> None:
    samples = [s for g in groups for s in g]
    assert len(groups) == PROMPTS and all(len(g) == N for g in groups)
    assert sorted(s.index for s in samples) == list(range(PROMPTS * N))  # each exactly once
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert s.weight_version == 1
        assert 0 < s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) <= 8
        assert s.reward in (0.0, 1.0)


def test_round_completes_over_two_engines(engines, model: Path, tmp_path: Path) -> None:
    router, servers = engines
    before = [e.served() for e in servers]
    groups = generate_rollout(_args(model, router), 0, _buffer(tmp_path))
    _check_complete(groups)
    assert all(e.served() > n for e, n in zip(servers, before)), "the router did not spread the round over both engines"


def test_round_survives_an_engine_killed_mid_round(cluster, model: Path, tmp_path: Path) -> None:
    router, (victim, survivor) = cluster
    result: dict = {}
    # Long enough responses that the kill lands while the round is in flight.
    args = replace(_args(model, router), rollout_max_response_len=8, rollout_concurrency=8)
    worker = threading.Thread(target=lambda: result.update(groups=generate_rollout(args, 0, _buffer(tmp_path))))
    worker.start()
    wait_for(lambda: victim.served() >= 4, 120, "the victim engine to serve a few requests")
    os.kill(victim.proc.pid, signal.SIGKILL)
    worker.join(timeout=300)
    assert not worker.is_alive(), "the round did not finish with one engine left"
    _check_complete(result["groups"])
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    assert router.workers().keys() == {survivor.url}, "the dead engine was not taken out of the router"
    # The requests the dead engine held came back as router errors and were sent again: counted.
    assert args.request_counts.retried > 0


def keep_even_groups(args, group) -> bool:
    """A dynamic-sampling filter for the test: keep groups with an even group index."""
    return group[0].group_index % 2 == 0


def test_dynamic_sampling_generates_until_enough_groups_pass(engines, model: Path, tmp_path: Path) -> None:
    router, _ = engines
    args = replace(_args(model, router), rollout_batch_size=6, over_sampling_batch_size=4,
                   dynamic_sampling_filter_path=f"{__name__}.keep_even_groups")
    groups = generate_rollout(args, 0, _buffer(tmp_path))
    assert len(groups) == 6 and all(len(g) == N for g in groups)
    assert [g[0].group_index for g in groups] == [0, 2, 4, 6, 8, 10]  # batches of 4 until 6 pass, in order


def test_partial_rollout_keeps_unfinished_groups_for_the_next_round(engines, model: Path, tmp_path: Path) -> None:
    router, _ = engines
    # 12 groups start; the round needs 8, so 4 are still running (or just done) when it ends.
    args = replace(_args(model, router), rollout_batch_size=8, over_sampling_batch_size=12, partial_rollout=True,
                   dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                   rollout_max_response_len=32,
                   rm_type="toy", custom_rm_path=f"{__name__}.reward_by_index")
    buffer = _buffer(tmp_path)
    first = generate_rollout(args, 0, buffer)
    assert len(first) == 8 and len(buffer.pending) == 4
    carried = {g[0].group_index for g in buffer.pending}
    second = generate_rollout(args, 1, buffer)
    assert carried <= {g[0].group_index for g in second}, "carried-over groups were not resumed first"
    samples = [s for g in first + second for s in g]
    assert len({s.index for s in samples}) == len(samples) == 16 * N  # nothing generated twice or lost
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
    assert all(s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) for s in samples)


def reward_by_index(args, sample) -> float:
    """Rewards that differ within every group, so check_reward_nonzero_std keeps all of them."""
    return float(sample.index % 2)


def test_partial_rollout_continues_aborted_samples_where_they_stopped(engines, model: Path, tmp_path: Path) -> None:
    router, _ = engines
    # Few requests in flight and long responses: when 4 groups are done, others are mid-generation.
    args = replace(_args(model, router), rollout_batch_size=4, over_sampling_batch_size=12, partial_rollout=True,
                   rollout_concurrency=8, rollout_max_response_len=48, rollout_temperature=1.0,
                   dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                   custom_rm_path=f"{__name__}.reward_by_index")
    buffer = _buffer(tmp_path)
    generate_rollout(args, 0, buffer)
    carried = {s.index: (s.status, list(s.tokens), s.response_length) for g in buffer.pending for s in g}
    aborted = {i: c for i, c in carried.items() if c[0] is Status.ABORTED and c[2] > 0}
    assert aborted, f"no sample was aborted mid-generation: {[(c[0], c[2]) for c in carried.values()]}"
    resumed = {s.index: s for g in generate_rollout(replace(args, rollout_batch_size=8), 1, buffer) for s in g}
    for index, (_, tokens, length) in aborted.items():
        sample = resumed[index]
        assert sample.tokens[:len(tokens)] == tokens and sample.response_length > length, "restarted, not continued"
        assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED)


def test_slime_plugins_get_slimes_args_sample_flags_and_filter_verdicts(engines, model: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed doc's custom generate, verbatim (slime's `post` and `Sample` imported from slime's
    paths; it reads args.sglang_router_ip/port and sets sample.truncated and sample.aborted) and a
    filter returning DynamicFilterOutput(keep=False) for odd groups."""
    monkeypatch.setenv(API_KEY_ENV, API_KEY)  # as every step of a job has it
    router, _ = engines
    args = replace(_args(model, router), rollout_batch_size=4, over_sampling_batch_size=8,
                   custom_generate_function_path="tests.rollout.slime_plugins.generate",
                   dynamic_sampling_filter_path="tests.rollout.slime_plugins.even_groups_only")
    groups = generate_rollout(args, 0, _buffer(tmp_path))
    assert len(groups) == 4 and all(g[0].group_index % 2 == 0 for g in groups), "a dropped group was kept"
    for sample in (s for g in groups for s in g):
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.reward in (0.0, 1.0)
        assert sample.truncated == (sample.status is Status.TRUNCATED) and not sample.aborted


def test_slime_rollout_flags_reach_the_engines_and_the_round(engines, model: Path, tmp_path: Path) -> None:
    """--rollout-stop-token-ids (every token stops: one-token responses, kept in the text as slime's
    no_stop_trim keeps them), --rollout-sample-hook-path (runs before the reward), and a filter's
    keep_when_insufficient (groups it drops fill the rollout rather than another round)."""
    from rollout.tiny_model import vocabulary

    router, _ = engines
    args = replace(_args(model, router), rollout_batch_size=4, over_sampling_batch_size=8,
                   rollout_stop_token_ids=sorted(vocabulary().values()),
                   rollout_sample_hook_path=["tests.rollout.slime_plugins.answer_with_label"],
                   dynamic_sampling_filter_path="tests.rollout.slime_plugins.reject_with_fallback")
    groups = generate_rollout(args, 3, _buffer(tmp_path))
    assert len(groups) == 4, "the round ended without filling the rollout from the dropped groups"
    for sample in (s for g in groups for s in g):
        assert sample.status is Status.COMPLETED and sample.response_length == 1
        assert sample.metadata["hooked_at"] == 3 and sample.reward == 1.0
