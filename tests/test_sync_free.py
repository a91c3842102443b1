"""A steady-state training step reads nothing back from the device: the host waits only at logging
intervals (and validation and checkpoints), so on a GPU the next step's kernels queue ahead."""

import json

import pytest
from conftest import REPO, TINY_FIT, tiny_flags

from gpt_lightning.cli import main

FSDP2 = ["--config", str(REPO / "configs" / "fsdp2.yaml"), "--trainer.accelerator", "cpu", "--trainer.devices", "1"]


# 16-mixed with its GradScaler: on CPU the precision flag would turn it into bf16-mixed, the plugin keeps it.
FP16 = [
    "--trainer.precision",
    "null",
    "--trainer.plugins",
    json.dumps(
        {
            "class_path": "lightning.pytorch.plugins.MixedPrecision",
            "init_args": {"precision": "16-mixed", "device": "cpu"},
        }
    ),
]


# Muon with AdamW (not fused as one kernel): the guard's skip must stay on the device too.
MUON = ["--model.optimizer", "muon", "--trainer.gradient_clip_val", "1.0"]


@pytest.mark.parametrize("overlay", [[], FSDP2, FP16, MUON], ids=["single-device", "fsdp2", "16-mixed", "muon"])
def test_no_host_read_between_logging_intervals(small_text, tmp_path, overlay, in_process_group):
    probe = {"class_path": "host_reads.HostReadCounter", "init_args": {"out": str(tmp_path / "reads.json")}}
    main(
        [
            *TINY_FIT,
            *overlay,
            *tiny_flags(
                {
                    "data.data_path": small_text,
                    "data.block_size": 32,
                    "trainer.max_steps": 16,
                    "trainer.log_every_n_steps": 5,
                    "checkpoint.every_n_train_steps": 1000,
                    "throughput.warmup_steps": 2,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
            f"--trainer.callbacks+={json.dumps(probe)}",
        ]
    )
    record = json.loads((tmp_path / "reads.json").read_text())
    assert record["steps"] == 16
    reads = {int(step): where for step, where in record["reads"].items()}
    # Step k runs from its batch start to the next one's. The logger and the progress bar read values
    # when step k ends at a logging interval (k + 1 divisible by 5) and the bar shows them when step
    # k + 1 starts; the first step measures FLOPs. Every other step reads nothing back.
    allowed = {0} | {k for k in range(16) if (k + 1) % 5 == 0 or k % 5 == 0}
    between = {k: reads.get(k, []) for k in range(16) if k not in allowed}
    assert between and all(not where for where in between.values()), between
    assert any(reads.get(k) for k in allowed)  # the counter does see reads where they are allowed
