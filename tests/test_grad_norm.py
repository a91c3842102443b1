"""train/grad_norm is the gradients' norm before Lightning's clipping, which still clips."""

import pytest
import torch
from conftest import ONE_QUIET_CPU_STEP, TINY_MODEL
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import MixedPrecision

from gpt_lightning import GPTLightningModule, TokenStreamDataModule


def test_the_logged_norm_is_taken_before_clipping(small_text, tmp_path):
    module = GPTLightningModule(**TINY_MODEL)
    before = [p.detach().clone() for p in module.parameters()]
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    trainer = Trainer(
        accelerator="cpu",
        precision="32-true",
        max_steps=1,
        gradient_clip_val=1e-6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    assert float(trainer.callback_metrics["train/grad_norm"]) > 1e-2  # far above the clipping threshold
    # AdamW normalizes the step, so clipping shows in its first moment, not in the update size:
    # exp_avg = (1 - beta1) x the clipped gradient, so its total norm is 0.1 x 1e-6.
    state = trainer.optimizers[0].state
    moments = torch.stack([torch.linalg.vector_norm(state[p]["exp_avg"]) for p in module.parameters() if p in state])
    assert torch.linalg.vector_norm(moments).item() < 1e-6
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.parametrize(
    "optimizer, clip",
    [("adamw", None), ("adamw", 1.0), ("muon", 1.0)],
    ids=["fused-adamw", "fused-adamw-clipped", "muon-clipped"],
)
def test_16_mixed_logs_the_unscaled_norm_as_32_true_does(small_text, tmp_path, optimizer, clip):
    """Under 16-mixed the GradScaler owns overflows; the norm is still logged, unscaled (it was missing):
    fused AdamW unscales in its step, Lightning unscales for Muon before the hooks."""

    def logged_norm(**precision) -> float:
        torch.manual_seed(0)
        module = GPTLightningModule(**TINY_MODEL, optimizer=optimizer)
        data = TokenStreamDataModule(
            str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
        )
        trainer = Trainer(**ONE_QUIET_CPU_STEP, gradient_clip_val=clip, **precision)
        trainer.fit(module, data)
        return float(trainer.callback_metrics["train/grad_norm"])

    scaler = torch.amp.GradScaler("cpu")  # 2**16 to start: the scaled norm would be 65,536x
    half = logged_norm(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert half == pytest.approx(logged_norm(precision="32-true"), rel=0.02)
