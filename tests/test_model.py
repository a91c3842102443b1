import math

import pytest
import torch

from gpt_lightning.generation import generate
from gpt_lightning.model import GPT, GPTConfig

TINY = GPTConfig(block_size=16, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)


def test_default_config_is_gpt2_124m():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    assert model.num_parameters() == 124_439_808
    keys = list(model.state_dict())
    assert "transformer.h.11.attn.c_attn.weight" in keys and "transformer.wpe.weight" in keys
    assert model.lm_head.weight is model.transformer.wte.weight  # tied


def test_shapes_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (4, 16))
    targets = torch.randint(0, TINY.vocab_size, (4, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 16, TINY.vocab_size)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.3  # ln(50257) = 10.82
    logits, loss = model(idx)
    assert loss is None


def test_gpt2_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=64, vocab_size=512, block_size=32))
    assert model.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.count_nonzero(model.transformer.h[0].attn.c_attn.bias) == 0


def test_too_long_sequence_is_a_clear_error():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="longer than the model's block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)


def test_generate_appends_tokens_within_block_size():
    model = GPT(TINY).eval()
    out = generate(model, torch.zeros(2, 3, dtype=torch.long), max_new_tokens=20, top_k=5)
    assert out.shape == (2, 23)
    greedy = generate(model, torch.zeros(1, 3, dtype=torch.long), 5, temperature=0)
    assert torch.equal(greedy, generate(model, torch.zeros(1, 3, dtype=torch.long), 5, temperature=0))
