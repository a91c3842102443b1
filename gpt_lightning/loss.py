"""The training loss: the LM head's cross-entropy a chunk of rows at a time, so the (N, V) logits never
exist whole. Plain torch, as the model; ``GPT.forward(idx, targets, head_loss=chunked_cross_entropy)``
runs it in place of the logits and ``F.cross_entropy`` (docs/gpu-fast-path.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from gpt_lightning.precision import compute_dtype

# Rows of (N, C) whose logits ``chunked_cross_entropy`` makes at a time: a chunk's logits, log-softmax
# and gradient take 6 bytes a logit at their peak under bf16-mixed (eager, CUDA), 0.6 GB at V = 50304;
# F.cross_entropy's backward takes 10 bytes a logit of the whole (N, V): 8 GB at B=16, T=1024.
LOSS_CHUNK_ROWS = 2048


def chunked_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    chunk_rows: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` (softcapped as ``GPT.logits`` does) against
    ``targets`` (N,), for ``h`` (N, C) and ``weight`` (V, C): ``F.cross_entropy``'s loss and gradients
    (rows with ``ignore_index`` left out, as it does), without the (N, V) logits (``ChunkedCrossEntropy``);
    ``chunk_rows`` None: ``LOSS_CHUNK_ROWS``."""
    h = h.to(compute_dtype(h.device.type, h.dtype))  # autocast's matmul dtype, as the head's Linear would run in
    return ChunkedCrossEntropy.apply(
        h, weight, targets, softcap, chunk_rows or LOSS_CHUNK_ROWS, ignore_index, torch.is_grad_enabled()
    )


class ChunkedCrossEntropy(torch.autograd.Function):
    """Each chunk's logits (in ``h``'s dtype) and their float32 log-softmax, freed before the next chunk.
    Under bfloat16 and float32 the gradients are made in the forward with the loss (as Liger's fused linear
    cross-entropy) and scaled by the backward; under float16, in the backward from the logits made again,
    scaled by ``grad_loss`` before the cast, as ``F.cross_entropy``'s: float16 cannot hold softmax / N."""

    @staticmethod
    def forward(ctx, h, weight, targets, softcap, chunk_rows, ignore_index, grad_enabled):
        # The forward runs with grad mode off: whether the caller's was on comes in ``grad_enabled``.
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        ctx.recompute = (need_h or need_w) and h.dtype == torch.float16
        ctx.options = softcap, chunk_rows, ignore_index, need_h, need_w
        count = (targets != ignore_index).sum()  # (), the rows the mean is over; a tensor: no host sync
        # (), float32 (float64 under 64-true); all rows ignored: zero gradients, as F.cross_entropy's
        inv_count = 1.0 / count.clamp_min(1).to(torch.promote_types(h.dtype, torch.float32))
        precompute = not ctx.recompute
        total, grad_h, grad_w = _loss_and_gradients(
            h, weight, targets, inv_count, *ctx.options[:3], need_h and precompute, need_w and precompute
        )
        if ctx.recompute:
            ctx.save_for_backward(h, weight, targets, inv_count)
        else:
            ctx.save_for_backward(grad_h, grad_w)
        return total / count  # all rows ignored: 0 / 0, nan, as F.cross_entropy's

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.recompute:
            h, weight, targets, inv_count = ctx.saved_tensors
            _, grad_h, grad_w = _loss_and_gradients(h, weight, targets, grad_loss.float() * inv_count, *ctx.options)
            return grad_h, grad_w, None, None, None, None, None
        grad_h, grad_w = ctx.saved_tensors  # out of place: a second backward (retain_graph) finds them intact
        grad_h = None if grad_h is None else (grad_h * grad_loss).to(grad_h.dtype)
        grad_w = None if grad_w is None else grad_w * grad_loss
        return grad_h, grad_w, None, None, None, None, None


def _loss_and_gradients(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    softcap: float | None,
    chunk_rows: int,
    ignore_index: int,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The loss summed over the rows of ``h`` (N, C), and the gradients of the loss summed times ``scale``
    ((), float32) of ``h`` (N, C) (in its dtype) and of ``weight`` (V, C), each if asked for, a chunk of
    ``chunk_rows`` rows at a time. The loss, the log-softmax and the weight's gradient are float32 (float64
    for a float64 ``h``: ``64-true``)."""
    N = h.size(0)
    exact = torch.promote_types(h.dtype, torch.float32)  # float32, or float64 under 64-true
    w = weight.to(h.dtype)  # (V, C): autocast's copy of the weight, made here (bf16 under bf16-mixed)
    grad_h = torch.empty_like(h) if need_h else None  # (N, C)
    grad_w = torch.zeros(w.shape, dtype=exact, device=w.device) if need_w else None  # (V, C)
    total = torch.zeros((), dtype=exact, device=h.device)
    for start in range(0, N, chunk_rows):
        x, t = h[start : start + chunk_rows], targets[start : start + chunk_rows, None]  # (n, C), (n, 1)
        valid = t != ignore_index  # (n, 1)
        t = t.where(valid, 0)  # (n, 1): ignored rows gather class 0, then are masked out
        logits = x @ w.t()  # (n, V), in h's dtype
        z = None
        if softcap is not None:  # cap * tanh(logits / cap), in float32; z = tanh(logits / cap) kept for the gradient
            z = logits.to(exact).div_(softcap).tanh_()  # (n, V)
            del logits
            logits = z * softcap  # (n, V), float32 (float64)
        logp = F.log_softmax(logits, dim=-1, dtype=exact)  # (n, V)
        del logits
        total = total - logp.gather(1, t).where(valid, 0).sum()
        if not (need_h or need_w):
            del logp, z  # before the next chunk's: one chunk's at a time (validation, float16's forward)
        else:
            # softmax - onehot, scaled in float32 (ignored rows 0), then cast for the matmuls; the targets'
            # entries made apart and written in after the cast: the rest of the row is then one pass from the
            # logits to half precision, which inductor fuses (a scatter into it kept a float32 (n, V) copy).
            rows = valid * scale  # (n, 1)
            g = logp.exp_()  # (n, V)
            g_t = g.gather(1, t) - 1  # (n, 1)
            if z is not None:  # d(cap * tanh(l / cap)) / dl = 1 - tanh^2
                slope = z.square_().neg_().add_(1)  # (n, V)
                g.mul_(slope)
                g_t = g_t * slope.gather(1, t)
                del slope
            del logp, z
            g = g.mul_(rows).to(h.dtype)  # (n, V)
            g.index_put_((torch.arange(g.size(0), device=g.device)[:, None], t), (g_t * rows).to(h.dtype))
            if need_h:
                grad_h[start : start + chunk_rows] = g @ w  # (n, C)
            if need_w:
                grad_w += (g.t() @ x).to(exact)  # (V, C)
            del g
    return total, grad_h, grad_w
