"""The training loss in chunks (``gpt_lightning.loss``): F.cross_entropy's loss and gradients without
the whole logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.model import GPT, GPTConfig


@pytest.mark.parametrize(
    "switches", [{}, {"logit_softcap": 15.0, "tie_embeddings": False}], ids=["gpt2", "softcap,untied"]
)
def test_the_chunked_training_loss_is_cross_entropy_s_loss_and_gradients(switches, monkeypatch):
    """The training path (``head_loss``) never makes the whole logits; its loss and gradients are
    F.cross_entropy's over them, masked targets (-100, its ignore_index) left out, to float32 rounding,
    and under bf16 autocast to bf16's. Without grad mode it does the logits path's matmuls, no more."""
    import gpt_lightning.loss

    monkeypatch.setattr(gpt_lightning.loss, "LOSS_CHUNK_ROWS", 48)  # 3 chunks of 128 rows, the last short
    config = GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=2, n_embd=32, **switches)
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 300, (4, 32)), torch.randint(0, 300, (4, 32))
    targets[:, :5] = -100  # a fine-tuning batch's masked prompt
    for mixed, tolerance in ((False, 1e-5), (True, 1e-2)):
        results = []
        for head_loss in (None, chunked_cross_entropy):
            torch.manual_seed(0)
            model = GPT(config)
            with torch.autocast("cpu", torch.bfloat16, enabled=mixed):
                logits, loss = model(idx, targets, head_loss=head_loss)
            loss.backward()
            results.append((logits, loss, {name: p.grad for name, p in model.named_parameters()}))
        (logits, loss, grads), (none, chunked, chunked_grads) = results
        assert logits.shape == (4, 32, 300) and none is None
        assert chunked.item() == pytest.approx(loss.item(), rel=tolerance / 10)
        for name, grad in grads.items():  # the head's weight included (tied: the embedding's too)
            assert torch.allclose(chunked_grads[name], grad, rtol=tolerance, atol=tolerance * grad.abs().max()), (
                mixed,
                name,
            )
        for no_grad in (torch.no_grad, torch.inference_mode):  # no gradients made: the head's one matmul
            flops = []
            for head_loss in (None, chunked_cross_entropy):
                with (
                    no_grad(),
                    torch.autocast("cpu", torch.bfloat16, enabled=mixed),
                    FlopCounterMode(display=False) as counter,
                ):
                    loss = model(idx, targets, head_loss=head_loss)[1]
                flops.append(counter.get_total_flops())
            assert flops[1] == flops[0], (mixed, no_grad)
            assert loss.item() == pytest.approx(chunked.item(), rel=1e-6)


def test_the_chunked_loss_backs_up_twice_and_ignores_as_cross_entropy_does():
    """``retain_graph`` backwards (and ``autograd.grad``) give F.cross_entropy's gradients each time; its
    gradients are not differentiable (an error, not a silent zero); every target ignored: nan, as its."""
    torch.manual_seed(0)
    h, weight = torch.randn(10, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 20, (10,))
    targets[3] = -100
    reference = F.cross_entropy(h @ weight.t(), targets)
    loss = chunked_cross_entropy(h, weight, targets, chunk_rows=4)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    expected = torch.autograd.grad(reference, (h, weight))
    for _ in range(2):
        for grad, want in zip(torch.autograd.grad(loss, (h, weight), retain_graph=True), expected):
            assert torch.allclose(grad, want, atol=1e-6)
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.allclose(h.grad, 2 * expected[0], atol=1e-6) and torch.allclose(
        weight.grad, 2 * expected[1], atol=1e-6
    )
    scale = torch.ones((), requires_grad=True)  # a graph through the gradient, whose h-part would be missing
    grad_h = torch.autograd.grad(chunked_cross_entropy(h, weight, targets, chunk_rows=4), h, scale, create_graph=True)[
        0
    ]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_h.sum().backward()
    ignored = torch.full((10,), -100)
    loss = chunked_cross_entropy(h, weight, ignored, chunk_rows=4)
    reference = F.cross_entropy(h @ weight.t(), ignored)
    assert loss.isnan() and reference.isnan()
    assert torch.equal(torch.autograd.grad(loss, h)[0], torch.autograd.grad(reference, h)[0])  # zeros
