"""bf16-mixed eager training is ``torch.autocast``'s own: the package's step (Lightning's precision
plugin, the loss, the non-finite guard and its norm, clipping, fused AdamW with ``found_inf``) adds
no rounding of its own. Why eager and compiled bf16 curves still part: docs/benchmarks.md."""

import copy

import torch
from conftest import TINY_MODEL
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from gpt_lightning.training.module import GPTLightningModule


def test_bf16_mixed_eager_steps_are_a_plain_autocast_loop_s_bit_for_bit():
    seed_everything(0)
    module = GPTLightningModule(**TINY_MODEL, block_size=32, val_sample_tokens=0)
    plain = copy.deepcopy(module)
    batches = [(x, x.roll(-1, dims=1)) for x in torch.randint(0, 50257, (4, 2, 32))]
    trainer = Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=len(batches),
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))

    optimizer = plain.configure_optimizers()
    assert optimizer.defaults["fused"]  # the same kernel as the run's
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = plain.model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for (name, ours), theirs in zip(module.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(ours, theirs), name
