"""``precision: auto`` (the CPU configs'): bf16-mixed where the CPU or GPU runs bfloat16 natively, 32-true
where it emulates it, decided by a measured bf16 vs float32 matmul; and one line for a run that asks
for bf16 on a CPU that emulates it (issue 47: the quick start took hours on an AVX2 laptop CPU)."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import ONE_QUIET_CPU_STEP, REPO, TINY_FIT, TINY_MODEL, tiny_flags
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from gpt_lightning.cli import main
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.precision import PRECISIONS
from gpt_lightning.training import precision
from gpt_lightning.training.module import GPTLightningModule

# Without native bf16 (AMD before Zen 4, Intel's client cores) oneDNN falls back to AVX2: these force it.
EMULATE = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.parametrize("name", PRECISIONS)
@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_each_precision_is_what_lightning_runs(name):
    """The table's dtypes and GradScaler are Lightning's own: a Linear under its precision plugin (16-mixed's
    built for CUDA, where it runs: on a CPU Lightning makes it bf16-mixed)."""
    if name == "16-mixed":
        plugin = MixedPrecision(name, "cuda")
        plugin.forward_context = lambda: torch.autocast("cpu", dtype=torch.float16)  # the CUDA one, on the CPU
    else:
        plugin = Trainer(accelerator="cpu", precision=name, logger=False).precision_plugin
    layer = plugin.convert_module(torch.nn.Linear(2, 2))
    with plugin.forward_context():
        out = layer(torch.ones(1, 2, dtype=layer.weight.dtype))
    assert (out.dtype, layer.weight.dtype) == (PRECISIONS[name].matmul, PRECISIONS[name].weights)
    assert (getattr(plugin, "scaler", None) is not None) == PRECISIONS[name].scaler


@pytest.mark.parametrize(
    "slowdown, expected", [(24.0, "32-true"), (3.0, "32-true"), (1.5, "bf16-mixed"), (0.5, "bf16-mixed")]
)
def test_auto_on_a_cpu_follows_the_measured_bf16_matmul(slowdown, expected, monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: slowdown)
    chosen, why = precision.fast_precision("cpu")
    assert chosen == expected
    assert ("emulates bf16" in why) == (expected == "32-true")
    assert (f"{slowdown:.0f}x slower" if expected == "32-true" else f"{slowdown:.1f}x float32's time") in why


@pytest.mark.parametrize("has_bf16, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_on_a_cuda_gpu_follows_its_bf16(has_bf16, expected, monkeypatch):
    """(The GPU is stood in for: no CUDA here.) A V100 or T4 gets float32, not float16 unasked."""
    monkeypatch.setattr(precision, "cuda_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: pytest.fail("a GPU run measured the CPU"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # Lightning's CUDAAccelerator.is_available reads it
    assert precision.fast_precision("cuda")[0] == precision.fast_precision("gpu")[0] == expected
    assert precision.fast_precision("auto")[0] == expected


class FakeNVML:
    """libnvidia-ml's calls ``nvml_compute_capability`` makes, for a GPU of compute capability ``capability``."""

    def __init__(self, capability):
        self.capability = capability

    def nvmlInit_v2(self):
        return 0

    nvmlShutdown = nvmlInit_v2

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        return 0 if index.value == 0 else 2  # NVML_ERROR_INVALID_ARGUMENT

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.capability
        return 0


@pytest.mark.parametrize("capability, native", [((8, 0), True), ((9, 0), True), ((7, 5), False), ((7, 0), False)])
def test_the_gpu_s_bf16_is_asked_of_nvml_until_cuda_is_initialized(capability, native, monkeypatch):
    """A parent that has not initialized CUDA must not (ddp_fork, ddp_notebook: its forked processes could
    not use CUDA then), nor leave a child behind it: NVML, which needs no CUDA context, tells the compute
    capability in this process (native bf16 from 8.0: a V100 or T4 emulates it); once CUDA is initialized,
    CUDA's own check runs. Before, a child process with no parent-death signal asked, for up to 120 s."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(precision.ctypes, "CDLL", lambda name: FakeNVML(capability))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child process was started"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a child process was started"))
    assert precision.cuda_has_bf16.__wrapped__() is native and asked == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert precision.cuda_has_bf16.__wrapped__() is True and asked == [1]


def test_where_nvml_cannot_answer_cuda_is_asked_with_a_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # NVML's GPU 1: this fake has none
    monkeypatch.setattr(precision.ctypes, "CDLL", lambda name: FakeNVML((8, 0)))
    with pytest.warns(UserWarning, match=r"NVML could not tell whether this GPU has bf16 \(NVML status 2\)"):
        assert precision.cuda_has_bf16.__wrapped__() is True
    monkeypatch.setattr(precision.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError("no libnvidia-ml")))
    with pytest.warns(UserWarning, match="no libnvidia-ml"):
        assert precision.cuda_has_bf16.__wrapped__() is True


def test_the_probe_measures_what_this_cpu_does():
    """On this CPU, as it is: auto picks bf16 exactly where its matmul is not over twice float32's time.
    Cached: measured once per process."""
    slowdown = precision.cpu_bf16_slowdown()
    assert 0 < slowdown and precision.cpu_bf16_slowdown() is slowdown
    assert precision.fast_precision("cpu")[0] == ("32-true" if slowdown > precision.EMULATED else "bf16-mixed")
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}  # torch >= 2.10
    if (capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")) and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert slowdown < precision.EMULATED


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's x86 ISA switch")
def test_the_probe_finds_emulated_bf16_where_onednn_may_not_use_the_cpus_bf16():
    """As on an AVX2 CPU (the issue's: a bf16 matmul at 1.4 GFLOPS against float32's 45): auto picks 32-true."""
    code = "from gpt_lightning.training.precision import fast_precision, cpu_bf16_slowdown; print(cpu_bf16_slowdown(), *fast_precision('cpu'))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **EMULATE},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    slowdown, chosen, *_ = result.stdout.split()
    assert float(slowdown) > 2 * precision.EMULATED and chosen == "32-true", result.stdout


SHRUNK = tiny_flags(
    {
        "data.block_size": 32,
        "trainer.max_steps": 2,
        "throughput.warmup_steps": 1,
        "trainer.enable_model_summary": False,
    }
)


@pytest.mark.parametrize("asked", ["auto", "bf16-mixed"])
def test_fit_on_a_cpu_that_emulates_bf16(asked, tmp_path, monkeypatch, caplog, capsys, recwarn, in_process_group):
    """``gpt-lightning fit --config configs/tiny-cpu.yaml`` (auto) trains in float32 there and says why;
    asked for bf16-mixed it trains in it, told once how much slower it is and what to type."""
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 24.0)
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    main(
        [
            *TINY_FIT,
            *SHRUNK,
            "--trainer.precision",
            asked,
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "logs"),
        ]
    )
    out, err = capsys.readouterr()
    console = caplog.text + out + err
    told = [str(w.message) for w in recwarn if "emulates bf16" in str(w.message)]
    (run,) = (tmp_path / "logs" / "tiny-cpu").glob("version_*")
    ran = json.loads((run / "throughput.json").read_text())["precision"]
    if asked == "auto":
        assert ran == "32-true" and not told
        assert (
            "precision auto: 32-true (this CPU emulates bf16: a bf16 matmul runs 24x slower than float32, measured)."
            in console
        )
    else:
        assert ran == "bf16-mixed" and "precision auto" not in console
        assert len(told) == 1 and "\n" not in told[0], told
        assert "bf16-mixed on this CPU is slow" in told[0] and "24x slower" in told[0]
        assert "--trainer.precision 32-true" in told[0]


def test_a_plain_trainer_in_bf16_on_such_a_cpu_is_told_once_per_run(monkeypatch, recwarn):
    """Without our CLI (a plain ``Trainer``, a stock ``LightningCLI``): told by the module, once for fit and validate."""
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 24.0)
    module = GPTLightningModule(**TINY_MODEL, block_size=16, val_sample_tokens=0)
    batches = [(x, x.roll(-1, dims=1)) for x in torch.randint(0, 50257, (2, 2, 16))]
    quiet = {**ONE_QUIET_CPU_STEP, "limit_val_batches": None}  # validate runs its batches
    trainer = Trainer(**quiet, precision="bf16-mixed")
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    assert len([w for w in recwarn if "emulates bf16" in str(w.message)]) == 1
    Trainer(**quiet, precision="32-true").validate(module, DataLoader(batches, batch_size=None), verbose=False)
    assert len([w for w in recwarn if "emulates bf16" in str(w.message)]) == 1  # float32: nothing to say


def test_the_bf16_probe_leaves_the_global_random_state_alone():
    """The probe behind precision auto (and the bf16 warning) runs in setup, after a user's seed: drawing its
    matrices from the global generator gave the first fit in a process other dropout masks than the next."""
    from gpt_lightning.training import precision

    precision.cpu_bf16_slowdown.cache_clear()
    state = torch.get_rng_state()
    precision.cpu_bf16_slowdown()
    assert torch.equal(torch.get_rng_state(), state)


def test_validation_and_test_sum_their_metrics_in_float32_under_a_half_precision_module(tmp_path):
    """bf16-true and 16-true cast the whole module, the metrics' states with it: 8 batches of 1,024 tokens
    sum to ~88,000, past float16's largest value (inf before), and a bf16 sum stalls (1.4% high before)."""

    def validate(precision: str) -> dict[str, float]:
        torch.manual_seed(0)
        module = GPTLightningModule(**TINY_MODEL, val_sample_tokens=0)
        data = TokenStreamDataModule(batch_size=16, block_size=64, cache_dir=str(tmp_path))
        batches = {"limit_val_batches": 8, "limit_test_batches": 8}
        trainer = Trainer(**{**ONE_QUIET_CPU_STEP, **batches}, precision=precision)
        (metrics,) = (trainer.test if precision == "bf16-true" else trainer.validate)(module, data, verbose=False)
        return {name.split("/")[1]: value for name, value in metrics.items()}

    full = validate("32-true")
    for half, tolerance in (("16-true", 2e-3), ("bf16-true", 1e-2)):  # bf16-true through test/
        low = validate(half)
        for name in ("loss", "perplexity", "bpb"):
            assert low[name] == pytest.approx(full[name], rel=tolerance * (10 if name == "perplexity" else 1)), (
                half,
                name,
            )


def test_16_true_training_asks_for_an_epsilon_float16_can_hold(small_text, tmp_path):
    """AdamW's default eps, 1e-8, is 0 in float16: a 16-true fit diverged by its third step (loss 3,051, then
    nan). It is refused before the first step, saying what to give; with --model.eps 1e-4 it trains. The
    optimizer built is checked, not the module's setting: an --optimizer of the CLI's replaces it."""
    from gpt_lightning.errors import UserError

    class OwnOptimizer(GPTLightningModule):  # what LightningCLI's --optimizer torch.optim.AdamW makes
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=self.own_eps)

    def fit(own_eps=None, **hparams) -> float:
        torch.manual_seed(0)
        kind = GPTLightningModule if own_eps is None else OwnOptimizer
        module = kind(**TINY_MODEL, val_sample_tokens=0, learning_rate=3e-3, **hparams)
        module.own_eps = own_eps
        data = TokenStreamDataModule(data_path=str(small_text), batch_size=4, block_size=32, cache_dir=str(tmp_path))
        trainer = Trainer(**{**ONE_QUIET_CPU_STEP, "max_steps": 6}, precision="16-true")
        trainer.fit(module, data)
        return float(trainer.callback_metrics["train/loss"])

    with pytest.raises(UserError, match=r"16-true keeps AdamW's moments in float16.*--model.eps 1e-4"):
        fit()
    assert 0 < fit(eps=1e-4) < 11  # finite, and no higher than at the start (ln 50,257 = 10.8)
    with pytest.raises(UserError, match=r"eps 1e-08 .*--optimizer.eps"):
        fit(own_eps=1e-8, eps=1e-4)  # --model.eps does not reach an optimizer of the user's
    assert 0 < fit(own_eps=1e-4) < 11
