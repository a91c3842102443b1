"""What a training step logs: train/loss is the optimizer step's loss under gradient accumulation,
it and train/grad_norm are logged only on the steps the logger writes (and the last), and
--trainer.log_every_n_steps 0 (Lightning: no step logging) trains."""

import json

import pytest
from conftest import TINY_FIT, tiny_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main


def fit_tiny_config(small_text, tmp_path, *extra):
    """The tiny run (auto: bf16-mixed where the CPU has it) with validation samples, validating where ``extra`` asks."""
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "model.val_sample_tokens": None,
                    "data.data_path": small_text,
                    "data.block_size": 32,
                    "checkpoint.every_n_train_steps": 1000,
                    "throughput.warmup_steps": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
            *extra,
        ]
    )
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return run_dir, events


def test_train_loss_is_the_mean_over_the_steps_micro_batches(small_text, tmp_path):
    """build-nanogpt's loss_accum: with 4 micro-batches per optimizer step the logged loss is their
    mean, not the last one's."""
    probe = {"class_path": "grad_probes.StepLossProbe", "init_args": {"out": str(tmp_path / "loss.json")}}
    _, events = fit_tiny_config(
        small_text,
        tmp_path,
        "--trainer.accumulate_grad_batches",
        "4",
        "--trainer.max_steps",
        "3",
        "--trainer.log_every_n_steps",
        "1",
        f"--trainer.callbacks+={json.dumps(probe)}",
    )
    steps = json.loads((tmp_path / "loss.json").read_text())["steps"]
    assert len(steps) == 3 and all(len(step["micro_batch_losses"]) == 4 for step in steps)
    for step in steps:
        losses = step["micro_batch_losses"]
        assert step["logged"] == pytest.approx(sum(losses) / 4, rel=1e-5)
    # the case the mean is about: the last micro-batch's loss is measurably another number
    assert any(abs(step["micro_batch_losses"][-1] - step["logged"]) > 1e-3 for step in steps)
    written = [e.value for e in events.Scalars("train/loss")]
    assert written == pytest.approx([step["logged"] for step in steps])


def test_log_every_n_steps_0_trains_and_logs_no_steps(small_text, tmp_path, capsys):
    """Before, the module, the throughput monitor and the progress bar each divided by it."""
    run_dir, events = fit_tiny_config(
        small_text,
        tmp_path,
        "--trainer.log_every_n_steps",
        "0",
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
    )
    assert "4/4" in capsys.readouterr().out  # the bar counted every step
    assert "train/loss" not in events.Tags()["scalars"]  # no step logging, as Lightning means it
    assert len(events.Scalars("val/loss")) == 2  # validation still logs
    summary = json.loads((run_dir / "throughput.json").read_text())
    assert summary["measured_steps"] == 3 and summary["tokens_per_sec_median"] > 0
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_steps_the_logger_skips_log_nothing(small_text, tmp_path):
    """Each self.log costs host time in Lightning's result collection (about 1 ms a step on this CPU,
    benchmarks/lightning_overhead.py) for a value no logger writes: train/loss and train/grad_norm
    are logged at the logger's steps (every 3rd here) and at the run's last step (7), so
    callback_metrics ends on the final step's loss. Before, both were logged at every step."""
    probe = {"class_path": "grad_probes.LogCallsProbe", "init_args": {"out": str(tmp_path / "calls.json")}}
    _, events = fit_tiny_config(
        small_text,
        tmp_path,
        "--trainer.max_steps",
        "7",
        "--trainer.log_every_n_steps",
        "3",
        f"--trainer.callbacks+={json.dumps(probe)}",
    )
    report = json.loads((tmp_path / "calls.json").read_text())
    for name in ("train/loss", "train/grad_norm"):
        assert [step + 1 for step, logged in report["calls"] if logged == name] == [3, 6, 7], name
    written = events.Scalars("train/loss")
    assert len(written) == 2  # the logger's steps; the last step's value is in callback_metrics
    assert report["final_loss"] is not None and report["final_loss"] != pytest.approx(written[-1].value)


def test_a_step_where_a_callback_stops_the_run_logs_its_own_values(small_text, tmp_path):
    """Lightning writes the step at which a callback (Timer for max_time, a user's) stops the run in
    its on_train_batch_end, after the module's step hook asked whether to log: the module logs that
    step's values then, so the logger does not write the last logging step's loss again."""
    probe = {"class_path": "grad_probes.LogCallsProbe", "init_args": {"out": str(tmp_path / "calls.json")}}
    stop = {"class_path": "grad_probes.StopAtStep", "init_args": {"step": 4}}
    _, events = fit_tiny_config(
        small_text,
        tmp_path,
        "--trainer.max_steps",
        "10",
        "--trainer.log_every_n_steps",
        "3",
        f"--trainer.callbacks+={json.dumps(probe)}",
        f"--trainer.callbacks+={json.dumps(stop)}",
    )
    report = json.loads((tmp_path / "calls.json").read_text())
    assert [logged for _, logged in report["calls"]].count("train/loss") == 2  # steps 3 and 4
    written = events.Scalars("train/loss")
    assert [event.step for event in written] == [2, 3]  # Lightning's 0-based step numbers
    assert written[1].value != pytest.approx(written[0].value)  # step 4's own loss, not step 3's again
    assert report["final_loss"] == pytest.approx(written[1].value)


def test_a_run_kept_going_after_a_stop_logs_each_steps_own_values(small_text, tmp_path):
    """A stop before --trainer.min_steps is met leaves should_stop set while training goes on, and
    Lightning writes every step from then. The stop step's values were logged from
    on_train_batch_end, a second entry of the same names, read after the step hook's entry (logged at
    step 3, before the stop): each later step must refresh it, or the logger writes the stop step's
    values at every step to the end."""
    probe = {"class_path": "grad_probes.LogCallsProbe", "init_args": {"out": str(tmp_path / "calls.json")}}
    losses = {"class_path": "grad_probes.StepLossProbe", "init_args": {"out": str(tmp_path / "loss.json")}}
    stop = {"class_path": "grad_probes.StopAtStep", "init_args": {"step": 4}}
    # min_epochs 0: Lightning sets min_epochs=1 beside min_steps, and an epoch here is longer than the run
    _, events = fit_tiny_config(
        small_text,
        tmp_path,
        "--trainer.max_steps",
        "10",
        "--trainer.min_steps",
        "7",
        "--trainer.min_epochs",
        "0",
        "--trainer.log_every_n_steps",
        "3",
        f"--trainer.callbacks+={json.dumps(probe)}",
        f"--trainer.callbacks+={json.dumps(losses)}",
        f"--trainer.callbacks+={json.dumps(stop)}",
    )
    report = json.loads((tmp_path / "calls.json").read_text())
    # each written loss is its own step's, computed again by the probe from that step's batch
    steps = json.loads((tmp_path / "loss.json").read_text())["steps"]
    own = [
        sum(steps[event.step]["micro_batch_losses"]) / len(steps[event.step]["micro_batch_losses"])
        for event in events.Scalars("train/loss")
    ]
    assert [event.value for event in events.Scalars("train/loss")] == pytest.approx(own, rel=1e-5)
    for name in ("train/loss", "train/grad_norm"):
        written = events.Scalars(name)
        # the logging step 3, the stop (4), then every step to min_steps (Lightning's 0-based numbers)
        assert [event.step for event in written] == [2, 3, 4, 5, 6], name
        values = [event.value for event in written]
        assert all(a != pytest.approx(b) for a, b in zip(values, values[1:])), (name, values)  # each step's own
    assert report["final_loss"] == pytest.approx(events.Scalars("train/loss")[-1].value)
