"""The real torch.compile tests: no graph breaks, regional compilation compiles the block once, and a
compiled fit (either scope) really compiled and keeps plain checkpoint keys."""

import pytest
import torch
import torch._dynamo
from conftest import COMPILED_TINY
from lightning.pytorch import Trainer

from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.generation import generate
from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.training.module import GPTLightningModule


def test_forward_and_loss_have_no_graph_breaks(monkeypatch):
    import gpt_lightning.loss

    monkeypatch.setattr(gpt_lightning.loss, "LOSS_CHUNK_ROWS", 12)
    model = GPT(GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 128, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # The training loss in chunks (3 of 12 rows: the loop unrolled), under bf16 autocast as it trains,
    # and under float16's, whose backward makes the gradients.
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype):
            explain = torch._dynamo.explain(model.head_and_loss)
            explanation = explain(torch.randn(2, 16, 32, requires_grad=True), idx, chunked_cross_entropy)
        assert explanation.graph_break_count == 0, (dtype, explanation.break_reasons)


def test_regional_compilation_compiles_the_block_once():
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    module = GPTLightningModule(n_layer=3, n_head=2, n_embd=32, block_size=32, compile=True, compile_scope="blocks")
    module.configure_model()
    idx = torch.randint(0, 50257, (2, 32))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed, as the configs train
            loss = module(idx, idx)[1]
        loss.backward()
    # One graph for the Block (shared by all 3) and one for the head and loss; nothing recompiled.
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["recompiles"]
    assert module.is_compiled and not [k for k in module.state_dict() if "_orig_mod" in k]
    generate(module.model, idx[:, :4], 3)  # sampling runs eager: no graph for its growing lengths
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_fit_really_compiles_and_checkpoints_keep_plain_keys(scope, small_text, tmp_path):
    torch._dynamo.reset()
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    module = GPTLightningModule(**COMPILED_TINY, compile_scope=scope)
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.1, cache_dir=str(tmp_path)
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        default_root_dir=tmp_path,
    )
    with torch.profiler.profile() as profile:
        trainer.fit(module, data)
    assert module.is_compiled
    # Dynamo really captured graphs: fails if compile were a silent no-op.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames_before
    # A compiled CPU step's attention is SDPA's own choice, the flash kernel, forward and backward.
    ran = {event.key for event in profile.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ran
    ckpt = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(ckpt)
    keys = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"].keys()
    assert "model.transformer.wte.weight" in keys
    assert not [k for k in keys if "_orig_mod" in k]

    # The compiled run's checkpoint loads into an eager module: same weights, same outputs.
    eager = GPTLightningModule.load_from_checkpoint(ckpt, compile=False).eval()
    assert not eager.is_compiled
    idx = torch.randint(0, 50257, (2, 32))
    torch.testing.assert_close(eager(idx)[0], module.eval()(idx)[0], rtol=1e-4, atol=1e-4)
