"""generate_rollout: prompt groups from the buffer -> the router -> scored samples.

The round: groups are taken from the buffer and each is generated and scored (group_generate.py:
the samples through the request transport, request_transport.py, which retries, aborts and reports
failing engines, so a round finishes while any engine lives and every sample is returned exactly
once; then the sample hooks and the reward). With dynamic sampling, groups are generated until
enough pass the filter; groups still running then are aborted on the engines and, with
--partial-rollout, go back to the buffer with the tokens they have, to be continued in a later
round. A round stops early on a stop request (round_stop.py). A user
function that fails where a restart would fail again (it does not load, or raises outside any one
sample) raises PluginError (plugins.py); a round where every sample failed raises RolloutError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from rollout import debug_data
from rollout.buffer import DataBuffer
from rollout.filters import judge_group
from rollout.group_generate import GroupGenerator, UnfinishedSample
from rollout.plugin_contracts import DynamicSamplingFilter, RolloutFunction
from rollout.plugins import load_function, raised
from rollout.request_transport import RequestTransport
from rollout.rollout_args import RolloutArgs
from rollout.rollout_output import RolloutFnTrainOutput, train_groups
from rollout.round_stop import RoundStopped, Stop
from rollout.sample import Sample, numbered
from rollout.sample_errors import nothing_trainable

log = logging.getLogger(__name__)

__all__ = ["RolloutArgs", "UnfinishedSample", "generate_rollout", "run_rollout"]


def generate_rollout(args: RolloutArgs, rollout_id: int, data_buffer: DataBuffer | None,
                     evaluation: bool = False, stop: Stop | None = None) -> list[list[Sample]]:
    """data_buffer is None only where --rollout-function-path supplies every prompt. stop: a
    request that the built-in round end now (rollout.round_stop)."""
    return run_rollout(args, rollout_id, data_buffer, evaluation, stop).samples


def takes_a_stop(args: RolloutArgs) -> bool:
    """Whether run_rollout's stop can end the round: the built-in round's can; a --rollout-function-path
    (or the debug data it loads) runs without one."""
    return not args.rollout_function_path and not args.load_debug_rollout_data


def run_rollout(args: RolloutArgs, rollout_id: int, data_buffer: DataBuffer | None,
                evaluation: bool = False, stop: Stop | None = None) -> RolloutFnTrainOutput:
    """The rollout's groups and the metrics a --rollout-function-path reported with them."""
    if args.rollout_function_path:
        function: RolloutFunction = load_function(args.rollout_function_path, "--rollout-function-path")
        try:  # slime's call: evaluation by keyword, a data source with get_samples/add_samples
            groups, metrics = train_groups(function(args.for_plugins, rollout_id, data_buffer, evaluation=evaluation))
        except Exception as err:
            raise raised("--rollout-function-path", args.rollout_function_path, err,
                         f"in rollout {rollout_id}") from err
        return RolloutFnTrainOutput(groups, metrics)
    if args.load_debug_rollout_data:
        return RolloutFnTrainOutput(debug_data.load(args.load_debug_rollout_data, rollout_id))
    if data_buffer is None:
        raise ValueError("the built-in rollout draws prompts from a data buffer: give --prompt-data")
    groups = asyncio.run(_Round(args, rollout_id, data_buffer, evaluation, stop).run())
    if args.save_debug_rollout_data:
        debug_data.save(args.save_debug_rollout_data, rollout_id, [s for group in groups for s in group])
    return RolloutFnTrainOutput(groups)


class _Round:
    def __init__(self, args: RolloutArgs, rollout_id: int, buffer: DataBuffer, evaluation: bool,
                 stop: Stop | None) -> None:
        self.args, self.rollout_id, self.buffer, self.evaluation, self.stop = args, rollout_id, buffer, evaluation, stop
        self.transport = RequestTransport(
            args.router_url, args.api_key, router_timeout_s=args.router_timeout_s,
            concurrency=args.rollout_concurrency, retry_timeout_s=args.retry_timeout_s,
            check_timeout_s=args.engine_check_timeout_s, decode_speed=args.decode_speed, counts=args.request_counts,
            on_failure=args.engine_failure_handler, on_unresponsive=args.engine_unresponsive_handler)
        self.groups = GroupGenerator(args, self.transport, rollout_id, evaluation)
        self.keep: DynamicSamplingFilter | None = (
            load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
            if args.dynamic_sampling_filter_path and not evaluation else None)

    async def run(self) -> list[list[Sample]]:
        target = self.args.rollout_batch_size
        batch = self.args.over_sampling_batch_size or target  # more than target: the first to finish are kept
        kept: list[list[Sample]] = []
        stopping = asyncio.create_task(self.stop.wait()) if self.stop else None
        async with self.transport, self.groups.remote_rm or contextlib.nullcontext():
            running: set[asyncio.Task[list[Sample] | None]] = set()
            while len(kept) < target and not (stopping and stopping.done()):
                if not running:
                    self._stop_if_nothing_trainable()  # else another batch would fail the same way
                    running = {asyncio.create_task(self.groups.group(g)) for g in self.buffer.get(batch)}
                finished, _ = await asyncio.wait(running | ({stopping} if stopping else set()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                finished.discard(stopping)
                running -= finished
                for left, task in enumerate(finished, 1):
                    group = task.result()
                    if group is None:
                        continue  # dropped: a user function failed on one of its samples
                    # groups kept or still able to be: slime's keep_when_insufficient counts them
                    candidates = len(kept) + len(running) + len(finished) - left + 1
                    if self.keep is None or self._judge(group, candidates, target):
                        kept.append(group)
            self.transport.stop()
            leftovers = await self._abort(running) if running else []
        if stopping and stopping.done():
            if self.args.partial_rollout:  # every group taken goes back, with what it has
                self.buffer.add(sorted(kept + leftovers, key=lambda g: numbered(g[0].group_index)))
            raise RoundStopped(f"rollout {self.rollout_id} stopped with {len(kept)} groups done")
        if stopping:
            stopping.cancel()
        self._stop_if_nothing_trainable()
        kept.sort(key=lambda g: numbered(g[0].group_index))
        for group in kept[target:]:
            leftovers.append(group)  # finished beyond the target: not wasted with partial rollout
        if self.args.partial_rollout:
            self.buffer.add(sorted(leftovers, key=lambda g: numbered(g[0].group_index)))
        return kept[:target]

    async def _abort(self, running: set[asyncio.Task[list[Sample] | None]]) -> list[list[Sample]]:
        """Abort what is still generating; its groups come back with the tokens they have."""
        await self.transport.abort_all()
        return [group for group in await asyncio.gather(*running) if group is not None]

    def _judge(self, group: list[Sample], candidates: int, target: int) -> bool:
        assert self.keep is not None
        try:
            return judge_group(self.keep, self.args.for_plugins, group, candidates, target)
        except Exception as err:
            raise raised("--dynamic-sampling-filter-path", self.args.dynamic_sampling_filter_path or "", err,
                         f"on group {group[0].group_index} of rollout {self.rollout_id}") from err

    def _stop_if_nothing_trainable(self) -> None:
        g = self.groups
        if g.failed and (len(g.failed) >= g.finished_samples or not g.scored_groups):
            raise nothing_trainable(g.failed, g.finished_samples, g.dropped_groups, self.rollout_id)
