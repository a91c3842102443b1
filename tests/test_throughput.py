"""ThroughputMonitor arithmetic with a patched clock and a fake trainer, peak lookup, FLOP counts."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback

from gpt_lightning.observing.throughput import (
    ThroughputMonitor,
    _deciles,
    dense_peak_flops,
    peak_flops_for,
    precision_dtype,
)
from gpt_lightning.training.module import GPTLightningModule


class FakeStrategy:
    def __init__(self, world_size):
        self.world_size = world_size

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "sum"
        return tensor * self.world_size  # every rank measured the same


class FakeLogger:
    def __init__(self):
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))


class FakeModule:
    device = torch.device("cpu")
    is_compiled = True

    def __init__(self):
        self.logged: dict[str, list[float]] = {}

    def log(self, name, value, **kwargs):
        self.logged.setdefault(name, []).append(value)

    def training_flops(self, batch_size, seq_len):
        return 100.0 * batch_size * seq_len  # 100 FLOPs per token


def drive(monitor, trainer, module, clock, monkeypatch, steps, accumulate, validation_after=None):
    ticks = iter(clock)
    monkeypatch.setattr(ThroughputMonitor, "_now", staticmethod(lambda: next(ticks)))
    batch = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    monitor.on_train_start(trainer, module)
    for step in range(steps):
        for micro in range(accumulate):
            monitor.on_train_batch_start(trainer, module, batch, step * accumulate + micro)
            if micro == accumulate - 1:
                trainer.global_step += 1
            monitor.on_train_batch_end(trainer, module, {}, batch, step * accumulate + micro)
        if step == validation_after:
            monitor.on_validation_start(trainer, module)
    monitor.on_train_end(trainer, module)


def test_arithmetic_with_warmup_world_size_accumulation_and_validation(tmp_path, monkeypatch, caplog):
    trainer = SimpleNamespace(
        global_step=0,
        world_size=2,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        precision="32-true",
        is_global_zero=True,
        log_dir=str(tmp_path),
        datamodule=SimpleNamespace(batch_size=4, block_size=8),
        strategy=FakeStrategy(2),
        loggers=[FakeLogger()],
        callbacks=[],
    )
    module = FakeModule()
    monitor = ThroughputMonitor(warmup_steps=2, peak_flops=1000.0)
    # Step ends at 10 (compiling step), 13, 13.5, 14.5; validation; restart at 20; 20.5, 21.5.
    with caplog.at_level("INFO"):
        drive(
            monitor,
            trainer,
            module,
            [0, 10, 13, 13.5, 14.5, 20, 20.5, 21.5],
            monkeypatch,
            steps=6,
            accumulate=2,
            validation_after=3,
        )

    # Each optimizer step: 2 micro-batches x 32 tokens per rank.
    assert [s.tokens for s in monitor.steps] == [64] * 6
    assert [s.seconds for s in monitor.steps] == pytest.approx([10, 3, 0.5, 1.0, 0.5, 1.0])
    # The first (compiling) step and the warm-up total reach the logger once, when first known.
    assert trainer.loggers[0].calls == [({"throughput/first_step_s": 10, "throughput/warmup_s": 13}, 2)]
    assert "throughput/first_step_s" not in module.logged and "throughput/warmup_s" not in module.logged
    # Logged at steps 2 (warm-up only: nothing), 4 and 6: 128 tokens in 1.5 s per rank, twice.
    assert module.logged["throughput/tokens_per_sec"] == pytest.approx([256 / 1.5, 256 / 1.5])
    assert module.logged["throughput/tokens_per_sec_per_device"] == pytest.approx([128 / 1.5] * 2)
    assert module.logged["throughput/step_ms"] == pytest.approx([750, 750])
    assert module.logged["throughput/mfu"] == pytest.approx([128 / 1.5 * 100 / 1000] * 2)

    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert saved == monitor.summary
    # Per-rank step rates 128, 64, 128, 64 tokens/s; summed over the two ranks.
    assert saved["tokens_per_sec_median"] == pytest.approx(2 * 96)
    assert saved["tokens_per_sec_mean"] == pytest.approx(2 * 256 / 3)
    assert saved["tokens_per_sec_p10"] == pytest.approx(2 * 64)
    assert saved["tokens_per_sec_p90"] == pytest.approx(2 * 128)
    assert saved["step_ms_median"] == pytest.approx(750)
    assert saved["mfu"] == pytest.approx(96 * 100 / 1000)
    assert saved["measured_steps"] == 4 and saved["warmup_steps"] == 2
    assert saved["first_step_s"] == pytest.approx(10) and saved["warmup_s"] == pytest.approx(13)
    assert saved["world_size"] == 2 and saved["accumulate_grad_batches"] == 2
    assert saved["tokens_per_step_per_device"] == 64
    assert saved["tokens_per_optimizer_step"] == 128  # 2 ranks x 2 micro-batches x 4 x 8
    assert saved["tokens_trained"] == 6 * 128
    assert "ms/step, MFU 960.0%, 128 tokens per optimizer step)" in caplog.text
    assert (saved["batch_size"], saved["block_size"], saved["compiled"]) == (4, 8, True)
    for field in ("device", "precision", "torch", "lightning", "peak_host_rss_bytes", "flops_per_token"):
        assert saved[field]


def test_the_summary_checks_the_tokens_of_every_step_not_the_first(tmp_path, monkeypatch, caplog):
    """A loader of a user's own that ends an epoch with a short accumulation (2, 1, 2 micro-batches):
    no single token count per step is claimed, and the fewest, most and total are what was trained."""
    trainer = SimpleNamespace(
        global_step=0,
        world_size=2,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        precision="32-true",
        is_global_zero=True,
        log_dir=str(tmp_path),
        datamodule=None,
        strategy=FakeStrategy(2),
        loggers=[],
        callbacks=[],
    )
    module, monitor = FakeModule(), ThroughputMonitor(warmup_steps=0)
    ticks = iter(range(100))
    monkeypatch.setattr(ThroughputMonitor, "_now", staticmethod(lambda: next(ticks)))
    batch = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    monitor.on_train_start(trainer, module)
    for micro_batches in (2, 1, 2):
        for micro in range(micro_batches):
            monitor.on_train_batch_start(trainer, module, batch, 0)
            trainer.global_step += micro == micro_batches - 1
            monitor.on_train_batch_end(trainer, module, {}, batch, 0)
    with caplog.at_level("INFO"):
        monitor.on_train_end(trainer, module)
    saved = monitor.summary
    assert saved["tokens_per_optimizer_step"] is None and saved["tokens_per_step_per_device"] is None
    assert (saved["tokens_per_optimizer_step_min"], saved["tokens_per_optimizer_step_max"]) == (64, 128)  # 2 ranks
    assert saved["tokens_trained"] == 2 * 5 * 32
    assert "64 to 128 tokens per optimizer step: not every step trained the same" in caplog.text


class FakeTime(Callback):
    """The monitor's clock in a real fit, moved only here: 1 s per micro-batch (at its backward) and
    100 s per validation batch, so a step's measured time says which work it holds."""

    def __init__(self):
        self.now = 0.0

    def on_before_backward(self, trainer, pl_module, loss):
        self.now += 1.0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.now += 100.0


def fit_on_fake_time(small_text, tmp_path, monkeypatch, clock, callbacks, **trainer_args):
    """A real Trainer (bf16-mixed, as configs/tiny-cpu.yaml) of the tiny model, accumulating 2
    micro-batches a step, its monitors on ``clock``."""
    from conftest import TINY_MODEL
    from lightning.pytorch import Trainer

    from gpt_lightning.data.datamodule import TokenStreamDataModule

    monkeypatch.setattr(ThroughputMonitor, "_now", staticmethod(lambda: clock.now))
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, cache_dir=str(tmp_path))
    trainer = Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock, *callbacks],
        **{"logger": False, **trainer_args},
    )
    trainer.fit(GPTLightningModule(**TINY_MODEL), data)


def test_validation_inside_an_accumulation_pauses_the_step_clock(small_text, tmp_path, monkeypatch):
    """Accumulating 2 with val_check_interval 5 (Lightning counts micro-batches): the 5th micro-batch,
    the first of step 2, validates. Its step holds both micro-batches' time, not the second's alone
    (the clock restarted after validation: twice the tokens/s), and none of the validation's."""
    clock, monitor = FakeTime(), ThroughputMonitor(warmup_steps=0, filename=None)
    fit_on_fake_time(
        small_text, tmp_path, monkeypatch, clock, [monitor], max_steps=6, val_check_interval=5, limit_val_batches=1
    )
    assert clock.now == 6 * 2 + 2 * 100  # validated twice: inside step 2 and at the end of step 4
    assert [(s.index, s.seconds, s.tokens) for s in monitor.steps] == [(i, 2.0, 128) for i in range(6)]


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "hellaswag-first"])
def test_a_hellaswag_pass_is_timed_out_of_its_step_and_the_first_step_is_the_compiling_one(
    monitor_first, small_text, tmp_path, monkeypatch
):
    """HellaSwagEval scores as steps 0 and 3 start (1,000 s a pass here), whichever callback runs
    first. Step 0 was left out, so the first step timed was step 1: first_step_s was a warm step's
    and its tag never written (the FineWeb recipe scores at step 0). Now every step is timed, the
    first as the first, each without the pass."""
    import csv
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger
    from test_hellaswag import synthetic_examples, write_examples

    from gpt_lightning.evaluation import hellaswag_callback, periodic

    clock, monitor = FakeTime(), ThroughputMonitor(warmup_steps=2, filename=None)
    score = hellaswag_callback.count_correct

    def a_long_pass(*args, **kwargs):
        clock.now += 1000.0
        return score(*args, **kwargs)

    monkeypatch.setattr(hellaswag_callback, "count_correct", a_long_pass)
    monkeypatch.setattr(periodic, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    evaluator = hellaswag_callback.HellaSwagEval(
        str(write_examples(tmp_path / "val.jsonl", synthetic_examples(4))), every_n_steps=3, limit=4, batch_size=2
    )
    fit_on_fake_time(
        small_text,
        tmp_path,
        monkeypatch,
        clock,
        [monitor, evaluator] if monitor_first else [evaluator, monitor],
        max_steps=5,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path, name="csv"),
        log_every_n_steps=1,
    )
    assert [(s.index, s.seconds) for s in monitor.steps] == [(i, 2.0) for i in range(5)]
    assert [r["step"] for r in evaluator.results] == [0, 3, 5] and evaluator.durations == [1000.0] * 3
    assert monitor.summary["first_step_s"] == 2.0 and monitor.summary["warmup_s"] == 4.0
    (metrics,) = (tmp_path / "csv").glob("version_*/metrics.csv")
    written = [
        float(row["throughput/first_step_s"])
        for row in csv.DictReader(metrics.open())
        if row.get("throughput/first_step_s")
    ]
    assert written == [2.0]


@pytest.mark.parametrize(
    "values, p10, p90",
    [
        ([5.0], 5.0, 5.0),  # one measured step: both are that step
        ([128.0, 64.0, 128.0, 64.0], 64.0, 128.0),
        ([5.0, 1.0, 3.0, 9.0, 2.0, 8.0, 4.0], 1.6, 8.4),  # interpolated between points, as numpy.percentile
    ],
)
def test_p10_and_p90_are_linear_interpolated_percentiles(values, p10, p90):
    assert _deciles(values) == pytest.approx((p10, p90))


def test_cpu_without_peak_logs_no_mfu(tmp_path, monkeypatch):
    trainer = SimpleNamespace(
        global_step=0,
        world_size=1,
        accumulate_grad_batches=1,
        log_every_n_steps=1,
        precision="bf16-mixed",
        is_global_zero=True,
        log_dir=str(tmp_path),
        datamodule=None,
        strategy=FakeStrategy(1),
        loggers=[],
        callbacks=[],
    )
    module = FakeModule()
    drive(ThroughputMonitor(warmup_steps=1), trainer, module, [0, 5, 6, 7], monkeypatch, steps=3, accumulate=1)
    assert "throughput/mfu" not in module.logged
    assert module.logged["throughput/tokens_per_sec"] == pytest.approx([32, 32])
    assert json.loads((tmp_path / "throughput.json").read_text())["mfu"] is None


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA GH200 480GB", 989.4e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L40", 181.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
        ("NVIDIA GeForce RTX 5090", 209.5e12),
        ("NVIDIA RTX 6000 Ada Generation", 364.2e12),
        ("NVIDIA RTX A6000", 154.8e12),
        ("NVIDIA GeForce RTX 3090", 71e12),
        ("NVIDIA GeForce GTX 1080", None),
        ("NVIDIA GeForce RTX 4080", None),  # a word, not a prefix: "4080" is not "4090", "L4" not "L40S"
    ],
)
def test_dense_bf16_peaks(name, peak):
    assert dense_peak_flops(name, torch.bfloat16) == peak


@pytest.fixture
def matmul_precision():
    saved = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize(
    "precision, matmul, dtype",
    [
        ("bf16-mixed", "highest", torch.bfloat16),
        ("16-mixed", "high", torch.float16),
        ("32-true", "highest", torch.float32),
        ("32-true", "high", "tfloat32"),
        ("32-true", "medium", "tfloat32"),
        ("64-true", "high", torch.float64),  # float64's peak, not TF32's
    ],
)
def test_precision_names_the_key_of_lightnings_flops_table(precision, matmul, dtype, matmul_precision):
    matmul_precision(matmul)
    assert precision_dtype(precision) == dtype


@pytest.mark.parametrize(
    "name, tf32",
    [
        ("NVIDIA A100-SXM4-80GB", 156e12),
        ("NVIDIA H100 80GB HBM3", 494.7e12),
        ("NVIDIA H100 PCIe", 378e12),
        ("NVIDIA H200", 494.7e12),
        ("NVIDIA H100 NVL", 417.5e12),
    ],
)
def test_tf32_runs_get_a_dense_tf32_peak(name, tf32, matmul_precision, monkeypatch):
    """32-true with float32_matmul_precision "high" (TF32) has an MFU: Lightning's table spells the
    key "tfloat32"; asked for "tf32" it has no entry. No GPU needed: the device name is patched."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    matmul_precision("high")
    assert peak_flops_for(torch.device("cuda", 0), "32-true") == tf32
    if "H200" not in name and "NVL" not in name:  # Lightning's own figures for these are dense
        assert get_available_flops(torch.device("cuda", 0), precision_dtype("32-true")) == tf32


def test_an_unknown_gpu_says_how_to_give_its_peak(monkeypatch, caplog):
    """A device in neither table gets no MFU and one line naming it and --throughput.peak_flops,
    not Lightning's bare "FLOPs not found" warning."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    with caplog.at_level("INFO"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_flops_for(torch.device("cuda", 0), "bf16-mixed") is None
    lines = [r.getMessage() for r in caplog.records if "No MFU" in r.getMessage()]
    assert len(lines) == 1 and "'NVIDIA GeForce GTX 1080'" in lines[0] and "--throughput.peak_flops" in lines[0]


def test_no_peak_on_cpu():
    assert peak_flops_for(torch.device("cpu"), "bf16-mixed") is None


def test_measured_flops_agree_with_the_analytic_6n_formula_for_gpt2_124m():
    module = GPTLightningModule(compile=False)
    B, T, cfg = 16, 1024, module.config
    measured = module.training_flops(B, T)
    analytic = B * T * (6 * module.model.num_parameters() + 12 * cfg.n_layer * cfg.n_embd * T)
    assert measured == pytest.approx(analytic, rel=0.02)


def test_matmul_precision_is_set_before_the_device_is_set_up(monkeypatch, matmul_precision, small_text):
    """Lightning's CUDA accelerator prints "set torch.set_float32_matmul_precision" from setup_device
    when the precision is still "highest"; the module's setting must already be in force there."""
    from conftest import ONE_QUIET_CPU_STEP, TINY_MODEL
    from lightning.pytorch import Trainer
    from lightning.pytorch.accelerators import CPUAccelerator

    from gpt_lightning.data.datamodule import TokenStreamDataModule

    matmul_precision("highest")
    seen = []
    setup_device = CPUAccelerator.setup_device
    monkeypatch.setattr(
        CPUAccelerator,
        "setup_device",
        lambda self, device: (seen.append(torch.get_float32_matmul_precision()), setup_device(self, device))[1],
    )
    module = GPTLightningModule(**TINY_MODEL, block_size=32, float32_matmul_precision="high")
    data = TokenStreamDataModule(data_path=str(small_text), batch_size=2, block_size=32)
    trainer = Trainer(**ONE_QUIET_CPU_STEP)
    trainer.fit(module, data)
    assert seen == ["high"]
