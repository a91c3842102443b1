"""``--model.optimizer muon``: Muon on the blocks' matrices and AdamW on the rest, as one optimizer;
the warmup-stable-decay schedule; the combinations refused in one line; and a Muon-trained
checkpoint exported to Hugging Face GPT-2 unchanged."""

import copy
import json
import weakref

import pytest
import torch
from conftest import REPO, TINY_FIT, TINY_MODEL, tiny_flags
from lightning.pytorch import Trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils._python_dispatch import TorchDispatchMode

from gpt_lightning.cli import main
from gpt_lightning.errors import UserError
from gpt_lightning.training.module import GPTLightningModule
from gpt_lightning.training.optimizers import MuonWithAdamW, lr_multiplier

TINY_CPU = [*TINY_FIT, *tiny_flags({"model.n_layer": 2, "data.block_size": 32})]


def built(module: GPTLightningModule) -> torch.optim.Optimizer:
    configured = module.configure_optimizers()
    return configured["optimizer"] if isinstance(configured, dict) else configured


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    module = GPTLightningModule(**TINY_MODEL, optimizer="muon", muon_learning_rate=0.03, learning_rate=2e-3)
    optimizer = built(module)
    assert isinstance(optimizer, MuonWithAdamW)
    names = {id(p): name for name, p in module.model.named_parameters()}
    groups = {group["name"]: sorted(names[id(p)] for p in group["params"]) for group in optimizer.param_groups}
    assert groups["muon"] == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert groups["adamw"] == ["transformer.wpe.weight", "transformer.wte.weight"]  # wte is the tied head too
    assert all(p.dim() == 1 for group in optimizer.param_groups[2:] for p in group["params"])
    assert [g["lr"] for g in optimizer.param_groups] == [0.03, 2e-3, 2e-3]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.01, 0.0]
    assert optimizer.param_groups[0] is optimizer.muon.param_groups[0]  # one set of groups, scheduled once
    assert optimizer.param_groups[1] is optimizer.adamw.param_groups[0]


def test_its_state_dict_resumes_the_very_same_steps():
    """Saved after two steps and loaded into a fresh optimizer, the third step is bit for bit the one
    the first optimizer takes: the Muon buffers and the AdamW moments are in the state dict."""

    def step(module, optimizer, seed):
        torch.manual_seed(seed)
        x = torch.randint(0, 50257, (2, 16))
        module(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    first = GPTLightningModule(**TINY_MODEL, optimizer="muon")
    optimizer = built(first)
    for seed in (1, 2):
        step(first, optimizer, seed)
    second = copy.deepcopy(first)
    restored = built(second)
    saved = copy.deepcopy(optimizer.state_dict())
    restored.load_state_dict(saved)
    assert len(restored.state_dict()["state"]) == sum(1 for _ in first.parameters())
    assert restored.muon.state is restored.state and restored.param_groups[0] is restored.muon.param_groups[0]
    step(first, optimizer, 3)
    step(second, restored, 3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_set_found_inf_leaves_weights_and_moments_untouched():
    torch.manual_seed(0)
    module = GPTLightningModule(**TINY_MODEL, optimizer="muon", muon_weight_decay=0.1)
    optimizer = built(module)
    x = torch.randint(0, 50257, (2, 16))
    module(x, x)[1].backward()
    optimizer.step()  # moments exist
    before = copy.deepcopy((module.state_dict(), optimizer.state_dict()["state"]))
    for p in module.parameters():
        p.grad = torch.full_like(p, float("nan"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    after = (module.state_dict(), optimizer.state_dict()["state"])
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values()))
    for key, state in before[1].items():
        assert state.keys() == after[1][key].keys(), key
        assert all(torch.equal(v, after[1][key][k]) for k, v in state.items()), key


class LiveTensorPeak(TorchDispatchMode):
    """The most bytes held at once by tensors created inside the mode (in-place results and views
    are not new memory): a CPU stand-in for ``torch.cuda.max_memory_allocated`` that is exact and
    does not depend on the allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


def test_the_guarded_muon_step_is_torch_s_step_bit_for_bit_without_copying_the_weights():
    """With ``found_inf`` set and 0 (every step of a guarded run), three steps equal those of torch's
    own Muon and AdamW with no guard, bit for bit (weight decay on, so its gated factor is checked),
    and a step allocates at most a few matrices at once, not a copy of every Muon weight (the old
    step cloned them all: a peak above their total size)."""

    def run(guarded: bool) -> tuple[GPTLightningModule, MuonWithAdamW, int]:
        torch.manual_seed(0)
        module = GPTLightningModule(**{**TINY_MODEL, "n_layer": 4}, optimizer="muon", muon_weight_decay=0.1)
        optimizer = built(module)
        peak = 0
        for seed in range(3):
            torch.manual_seed(seed)
            x = torch.randint(0, 50257, (2, 16))
            module(x, x)[1].backward()
            if guarded:
                optimizer.found_inf = torch.zeros(())
            with LiveTensorPeak() as tracker:
                optimizer.step()
            peak = tracker.peak
            optimizer.zero_grad()
        return module, optimizer, peak

    (plain, plain_opt, _), (guarded, guarded_opt, peak) = run(False), run(True)
    for (name, a), b in zip(plain.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), name
    for key, state in plain_opt.state_dict()["state"].items():
        assert all(torch.equal(v, guarded_opt.state_dict()["state"][key][k]) for k, v in state.items()), key
    matrices = guarded_opt.muon.param_groups[0]["params"]
    largest, total = max(p.nbytes for p in matrices), sum(p.nbytes for p in matrices)
    assert peak < 5 * largest < total / 2, (peak, largest, total)


def test_muon_trains_where_adamw_is_not_fused(small_text, tmp_path, monkeypatch):
    """MPS and XPU get no fused AdamW, the part of the step that skips on the device; a non-fused
    AdamW asserts ``found_inf is None``. Forced here on the CPU, through a plain Trainer: Muon trains
    there, and a non-finite loss still stops the run in one line, at its own step (the host reads
    the guard each step, as for any optimizer that cannot skip on the device)."""
    from test_bad_input import NaNAtStep

    from gpt_lightning.data.datamodule import TokenStreamDataModule
    from gpt_lightning.training import module as module_file

    build = module_file.build_optimizer
    monkeypatch.setattr(
        module_file, "build_optimizer", lambda *args, **kwargs: build(*args, **{**kwargs, "fused": None})
    )

    def fit(module):
        data = TokenStreamDataModule(
            str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
        )
        trainer = Trainer(
            accelerator="cpu",
            precision="bf16-mixed",
            max_steps=5,
            log_every_n_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, data)

    good = GPTLightningModule(**TINY_MODEL, optimizer="muon")
    fit(good)
    assert good.global_step == 5 and not good.trainer.optimizers[0].adamw.defaults["fused"]
    bad = NaNAtStep(nan_step=3, **TINY_MODEL, optimizer="muon")
    with pytest.raises(UserError, match=r"became non-finite \(nan or inf\) at step 3\."):
        fit(bad)
    assert bad.global_step == 3 and all(torch.isfinite(p).all() for p in bad.parameters())


def test_the_wsd_schedule_warms_up_holds_then_decays_linearly():
    schedule = dict(
        warmup_steps=2, lr_schedule="wsd", cosine_decay_steps=None, decay_fraction=0.4, min_lr_ratio=0.0, total_steps=10
    )
    assert [lr_multiplier(step, **schedule) for step in range(10)] == pytest.approx(
        [0.5, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25]
    )


def test_a_torch_without_muon_gets_one_line(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(UserError, match=r"model.optimizer muon needs torch >= 2.9 \(torch.optim.Muon\); this is torch"):
        GPTLightningModule(**TINY_MODEL, optimizer="muon")


def test_muon_under_fsdp2_is_refused_in_one_line(small_text, tmp_path, capsys, in_process_group):
    with pytest.raises(SystemExit):
        main(
            [
                *TINY_CPU,
                "--config",
                str(REPO / "configs" / "fsdp2.yaml"),
                "--trainer.devices",
                "1",
                "--model.optimizer",
                "muon",
                "--data.data_path",
                str(small_text),
                "--trainer.max_steps",
                "1",
                "--trainer.logger.init_args.save_dir",
                str(tmp_path),
            ]
        )
    err = capsys.readouterr().err
    assert "model.optimizer muon does not run under FSDP2 (ModelParallelStrategy)" in err
    assert "--trainer.strategy ddp" in err and "Traceback" not in err


def test_a_muon_run_logs_each_group_s_rate_and_exports_to_hugging_face(small_text, tmp_path):
    """Through the CLI as users run it (tiny-cpu.yaml: auto, bf16-mixed where the CPU has it), with accumulation, clipping and the
    WSD schedule: one learning-rate tag per parameter group, and the checkpoint exports with
    ``export --format hf`` to a GPT-2 that transformers loads with the same logits."""
    transformers = pytest.importorskip("transformers")
    main(
        [
            *TINY_CPU,
            "--data.data_path",
            str(small_text),
            "--trainer.max_steps",
            "4",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.accumulate_grad_batches",
            "2",
            "--trainer.gradient_clip_val",
            "1.0",
            "--model.optimizer",
            "muon",
            "--model.lr_schedule",
            "wsd",
            "--model.warmup_steps",
            "1",
            "--model.decay_fraction",
            "0.5",
            "--model.min_lr_ratio",
            "0",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "tb"),
        ]
    )
    run_dir = tmp_path / "tb" / "tiny-cpu" / "version_0"
    events = EventAccumulator(str(run_dir))
    events.Reload()
    multipliers = [1.0, 1.0, 1.0, 0.5]  # steps 0-3 of 4: warm-up (1 step), stable, decay over the last 2
    for tag, peak in [("muon", 0.02), ("adamw", 1e-3), ("adamw_no_decay", 1e-3)]:
        rates = {e.step: e.value for e in events.Scalars(f"lr-MuonWithAdamW/{tag}")}  # (logged at each micro-batch)
        assert rates == pytest.approx({step: peak * m for step, m in enumerate(multipliers)}), tag
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 4 and all(0 < loss < 12 for loss in losses)

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert (
        "momentum_buffer" in torch.load(ckpt, map_location="cpu", weights_only=False)["optimizer_states"][0]["state"][0]
    )
    out = tmp_path / "hf"
    main(["export", "--format", "hf", "--ckpt_path", str(ckpt), "--out", str(out)])
    exported = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ours = GPTLightningModule.load_from_checkpoint(ckpt, compile=False).eval()
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], exported(idx).logits, rtol=0, atol=1e-5)
