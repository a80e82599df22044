"""A save-now signal ends the trainer's own rollout round (trainer.rollout_source's generate_abandonable)
through the round's polled stop (rollout.round_stop.PolledStop), not an exception raised into its event
loop: here the signal lands on another thread while the round's requests go to a router that is away,
and the round ends with the data buffer as before it and nothing recorded. (It found stopping a round
whose router is away raising RouterError. It does not reproduce the GPU's lost save-now, whose cause was
Triton's signal handlers: tests/trainer/test_save_now_signals.py.)
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from contract.job_dir import JobDir
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs
from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster.daemons import wait_for
from trainer import save_now
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_source import RolloutGenerator
from trainer.train_data import TrainData

RETRIES_S = 30.0  # the round's requests, refused, sent again a few times (backoffs of 0.2 s, doubling)


def test_a_save_now_signal_on_another_thread_abandons_the_round_and_restores_the_buffer(tmp_path: Path) -> None:
    buffer = DataBuffer(JsonlDataSource(write_toy_data(tmp_path / "toy.jsonl", num_prompts=50), label_key="label",
                                        n_samples_per_prompt=2, seed=3))
    # A router that refuses every connection: the round's requests wait and are sent again, as in a
    # rollout whose only engine is gone.
    args = RolloutArgs(hf_checkpoint=str(write_tiny_model(tmp_path / "model")), router_url="http://127.0.0.1:1",
                       rollout_batch_size=4, n_samples_per_prompt=2, rollout_max_response_len=4, rm_type="toy")
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, "flags")
    save_now_signal = save_now.install()
    generator = RolloutGenerator(args, buffer, journal, TrainData(None), save_now_signal)
    before = buffer.state_dict()

    def signal_from_this_thread() -> None:
        wait_for(lambda: args.request_counts.retried >= 8, RETRIES_S, "the round's requests sent again")
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # its handler's flag is tripped here

    sender = threading.Thread(target=signal_from_this_thread, daemon=True)
    sender.start()
    try:
        assert generator.generate_abandonable(0) is None
    finally:
        sender.join()
        save_now_signal.requested = False
    assert buffer.state_dict() == before, "the resumed run generates the rollout again, identically"
    assert journal.replay(0) is None, "nothing of the abandoned round is recorded"
