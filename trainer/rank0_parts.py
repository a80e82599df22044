"""What rank 0 alone holds: the engines, the reports, generation, evals and the weight transport
(built by trainer.loop_builder, used by the loop's parts and by --debug-rollout-only)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.engine_fleet import EngineFleet
from trainer.evals import EvalSchedule
from trainer.metrics import Reporter
from trainer.publish import WeightPublisher
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_source import RolloutGenerator


@dataclass
class Rank0Parts:
    fleet: EngineFleet
    reporter: Reporter
    generator: RolloutGenerator
    journal: RolloutJournal | None  # rollouts since the last checkpoint (only where there are checkpoints)
    evals: EvalSchedule
    transport: WeightPublisher | None  # None with --debug-train-only
