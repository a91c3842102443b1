"""The training loss in chunks (``gpt_lightning.loss``): F.cross_entropy's loss and gradients in every
precision Lightning trains in, without the whole logits."""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.utils.flop_counter import FlopCounterMode

from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.training.module import GPTLightningModule

PLUGINS = {
    "32-true": Precision,
    "bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),  # with its GradScaler, 2^16 to start
    "bf16-true": lambda: HalfPrecision("bf16-true"),
}


@pytest.mark.parametrize("precision", list(PLUGINS))
@pytest.mark.parametrize(
    "switches", [{}, {"logit_softcap": 15.0, "tie_embeddings": False}], ids=["gpt2", "softcap,untied"]
)
def test_the_chunked_loss_gives_cross_entropy_s_gradients_in_every_precision(precision, switches):
    """Two micro-batches accumulated as Lightning does (loss / 2, scaled by 16-mixed's GradScaler,
    unscaled before the optimizer step), through the module's training step under Lightning's precision
    plugin: every gradient is as far from float32's as F.cross_entropy's in the same precision, and
    the head's rows of ids absent from the batch are pushed down as there. A micro-batch is 2 chunks
    (2176 rows: 2048 and 128) of 4096 ids, the first 5 targets of each row ignored (-100)."""
    V, B, T = 4096, 17, 128
    torch.manual_seed(0)
    batches = []
    for _ in range(2):
        idx = torch.randint(0, V // 2, (B, T + 1))  # the upper half of the ids absent
        x, y = idx[:, :-1], idx[:, 1:].clone()
        y[:, :5] = -100
        batches.append((x, y))

    def gradients(chunked_loss: bool, plugin: Precision, weights_of: torch.nn.Module | None = None):
        torch.manual_seed(0)
        options = dict(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=32, **switches)
        module = GPTLightningModule(**options, compile=False, chunked_loss=chunked_loss)
        if weights_of is not None:  # the float32 reference: the low-precision module's weights, exactly
            module.load_state_dict({k: v.float() for k, v in weights_of.state_dict().items()})
        module = plugin.convert_module(module)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)  # plain: Lightning unscales for it
        scaler = getattr(plugin, "scaler", None)
        for batch_idx, batch in enumerate(batches):
            with plugin.forward_context():
                loss = module.training_step(batch, batch_idx) / 2  # Lightning's accumulation
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        return module, {name: p.grad.float() for name, p in module.named_parameters()}

    plugin = PLUGINS[precision]
    module, cross_entropy = gradients(False, plugin())
    _, chunked = gradients(True, plugin())
    _, reference = gradients(False, Precision(), weights_of=module)
    head = "model.lm_head.weight" if "tie_embeddings" in switches else "model.transformer.wte.weight"
    for name, want in reference.items():  # relative errors of the whole gradient
        ours, theirs = (((grads[name] - want).norm() / want.norm()).item() for grads in (chunked, cross_entropy))
        assert ours <= max(2 * theirs, 1e-5), (name, ours, theirs)
    for grads in (reference, cross_entropy, chunked):
        assert grads[head][V // 2 :].ne(0).any(dim=1).all(), "an absent id's row of the head got no gradient"


@pytest.mark.parametrize(
    "switches", [{}, {"logit_softcap": 15.0, "tie_embeddings": False}], ids=["gpt2", "softcap,untied"]
)
def test_the_chunked_loss_is_cross_entropy_s_loss_and_makes_no_more_matmuls_without_grad(switches, monkeypatch):
    """The training path (``head_loss``) never makes the whole logits; its loss and gradients are
    F.cross_entropy's over them, masked targets (-100, its ignore_index) left out, to float32 rounding,
    and under bf16 autocast to bf16's. Without grad mode it does the logits path's matmuls, no more."""
    import gpt_lightning.loss

    monkeypatch.setattr(gpt_lightning.loss, "LOSS_CHUNK_ROWS", 48)  # 3 chunks of 128 rows, the last short
    config = GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=2, n_embd=32, **switches)
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 300, (4, 32)), torch.randint(0, 300, (4, 32))
    targets[:, :5] = -100  # a fine-tuning batch's masked prompt
    for mixed, tolerance in ((None, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
        results = []
        for head_loss in (None, chunked_cross_entropy):
            torch.manual_seed(0)
            model = GPT(config)
            with torch.autocast("cpu", mixed or torch.bfloat16, enabled=mixed is not None):
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
                    torch.autocast("cpu", mixed or torch.bfloat16, enabled=mixed is not None),
                    FlopCounterMode(display=False) as counter,
                ):
                    loss = model(idx, targets, head_loss=head_loss)[1]
                flops.append(counter.get_total_flops())
            assert flops[1] == flops[0], (mixed, no_grad)
            assert loss.item() == pytest.approx(chunked.item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_chunked_loss_backs_up_twice_and_ignores_as_cross_entropy_does(dtype):
    """``retain_graph`` backwards (and ``autograd.grad``) give F.cross_entropy's gradients each time,
    float16's made in the backward too; its gradients are not differentiable (an error, not a silent
    zero); every target ignored: nan, as its."""
    torch.manual_seed(0)
    h, weight = torch.randn(10, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 20, (10,))
    targets[3] = -100
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    autocast = torch.autocast("cpu", torch.float16, enabled=dtype == torch.float16)
    with autocast:
        reference = F.cross_entropy(h @ weight.t(), targets)
        loss = chunked_cross_entropy(h, weight, targets, chunk_rows=4)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-3 if dtype == torch.float16 else 1e-6)
    expected = torch.autograd.grad(reference, (h, weight))
    for _ in range(2):
        for grad, want in zip(torch.autograd.grad(loss, (h, weight), retain_graph=True), expected):
            assert torch.allclose(grad, want, atol=atol)
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.allclose(h.grad, 2 * expected[0], atol=atol) and torch.allclose(
        weight.grad, 2 * expected[1], atol=atol
    )
    scale = torch.ones((), requires_grad=True)  # a graph through the gradient, whose h-part would be missing
    with autocast:
        loss = chunked_cross_entropy(h, weight, targets, chunk_rows=4)
    grad_h = torch.autograd.grad(loss, h, scale, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_h.sum().backward()
    ignored = torch.full((10,), -100)
    with autocast:
        loss = chunked_cross_entropy(h, weight, ignored, chunk_rows=4)
        reference = F.cross_entropy(h @ weight.t(), ignored)
    assert loss.isnan() and reference.isnan()
    assert torch.equal(torch.autograd.grad(loss, h)[0], torch.autograd.grad(reference, h)[0])  # zeros


@pytest.mark.parametrize("softcap", [None, 15.0], ids=["plain", "softcap"])
def test_the_chunked_loss_is_float64_under_64_true(softcap):
    """64-true's loss and gradients are F.cross_entropy's to float64's precision, not float32's."""
    torch.manual_seed(0)
    h = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1000, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 1000, (300,))
    loss = chunked_cross_entropy(h, w, targets, softcap, chunk_rows=128)
    logits = h @ w.t()  # (300, 1000)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    want = F.cross_entropy(logits, targets)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for ours, theirs in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-14)
    # The model's own logits (evaluation, sampling, --model.chunked_loss false) stay float64 too.
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=1000, block_size=8, logit_softcap=softcap)
    model = GPT(config).to(torch.float64)
    idx = torch.randint(0, 1000, (2, 8))
    plain, chunked = model(idx, idx)[1], model(idx, idx, head_loss=chunked_cross_entropy)[1]
    assert model.logits(torch.randn(16, dtype=torch.float64)).dtype == torch.float64
    torch.testing.assert_close(plain, chunked, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("chunk_rows, ignored", [(64, 7), (16, 7), (64, 1)])  # one chunk, three, all ignored
def test_the_gradient_is_softmax_minus_the_one_hot_scaled_then_cast_bit_for_bit(dtype, softcap, chunk_rows, ignored):
    """The targets' entries, made apart and written in after the cast, are the values of the plain formula:
    softmax with 1 taken off at the target, times the slope of the cap, times the scale, in float32 (float64
    for float64), cast once; ignored rows 0. Chunked, the input's gradient still is (its rows are the chunks')."""
    from gpt_lightning.loss import _loss_and_gradients

    torch.manual_seed(0)
    exact = torch.promote_types(dtype, torch.float32)
    h, w = torch.randn(40, 16).to(dtype), torch.randn(300, 16)
    targets = torch.randint(0, 300, (40,))
    targets[::ignored] = -100
    scale = torch.tensor(1 / 40, dtype=exact)
    _, grad_h, grad_w = _loss_and_gradients(h, w, targets, scale, softcap, chunk_rows, -100, True, True)
    x, t = h, targets[:, None]
    valid = t != -100
    logits = (x @ w.to(dtype).t()).to(exact)  # (40, 300)
    z = None if softcap is None else (logits / softcap).tanh()
    p = F.log_softmax(logits if z is None else z * softcap, dim=-1, dtype=exact).exp()  # as the loss takes it
    g = p.scatter_add(1, t.where(valid, 0), torch.full_like(t, -1, dtype=exact))  # softmax - onehot
    g = (g if z is None else g * (1 - z.square())) * (valid * scale)
    g = g.to(dtype)
    torch.testing.assert_close(grad_h, g @ w.to(dtype), rtol=0, atol=0)
    if chunk_rows >= 40:  # one chunk: the weight's gradient is one product too
        torch.testing.assert_close(grad_w, (g.t() @ x).to(exact), rtol=0, atol=0)
    if ignored == 1:
        assert not grad_h.any() and not grad_w.any()
