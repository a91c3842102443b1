"""The training loss: the LM head's cross-entropy a chunk of rows at a time, so the (N, V) logits never
exist whole. Plain torch, as the model; ``GPT.forward(idx, targets, head_loss=chunked_cross_entropy)``
runs it in place of the logits and ``F.cross_entropy`` (docs/gpu-fast-path.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

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
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    return ChunkedCrossEntropy.apply(
        h.to(dtype), weight, targets, softcap, chunk_rows or LOSS_CHUNK_ROWS, ignore_index, torch.is_grad_enabled()
    )


class ChunkedCrossEntropy(torch.autograd.Function):
    """The forward makes each chunk's logits (in ``h``'s dtype, as autocast's matmul), their float32
    log-softmax, the chunk's loss and, if ``grad_enabled``, its gradients (of ``h`` and, in float32, of
    ``weight``, as Liger's fused linear cross-entropy does), then frees the logits; the backward only
    scales the gradients. The head's three matmuls, as unchunked (one without gradients), no recompute."""

    @staticmethod
    def forward(ctx, h, weight, targets, softcap, chunk_rows, ignore_index, grad_enabled):
        # The forward runs with grad mode off: whether the caller's was on comes in ``grad_enabled``.
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        N = h.size(0)
        w = weight.to(h.dtype)  # (V, C): autocast's copy of the weight, made here (bf16 under bf16-mixed)
        grad_h = torch.empty_like(h) if need_h else None  # (N, C), of the mean loss
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None  # (V, C)
        count = (targets != ignore_index).sum()  # (), the rows the mean is over; a tensor: no host sync
        inv_count = 1.0 / count.clamp_min(1)  # (), float32; all rows ignored: zero gradients, as F.cross_entropy's
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, N, chunk_rows):
            x, t = h[start : start + chunk_rows], targets[start : start + chunk_rows, None]  # (n, C), (n, 1)
            valid = t != ignore_index  # (n, 1)
            t = t.where(valid, 0)  # (n, 1): ignored rows gather class 0, then are masked out
            logits = x @ w.t()  # (n, V), in h's dtype
            z = None
            if (
                softcap is not None
            ):  # cap * tanh(logits / cap), in float32; z = tanh(logits / cap) kept for the gradient
                z = logits.float().div_(softcap).tanh_()  # (n, V)
                del logits
                logits = z * softcap  # (n, V), float32
            logp = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (n, V)
            del logits
            total = total - logp.gather(1, t).where(valid, 0).sum()
            if need_h or need_w:
                g = logp.exp_().scatter_add_(1, t, torch.full_like(t, -1, dtype=logp.dtype))  # (n, V): softmax - onehot
                if z is not None:  # d(cap * tanh(l / cap)) / dl = 1 - tanh^2
                    g.mul_(z.square_().neg_().add_(1))
                del logp, z
                g = g.mul_(valid * inv_count).to(h.dtype)  # (n, V): of the mean loss, ignored rows 0, for the matmuls
                if need_h:
                    grad_h[start : start + chunk_rows] = g @ w  # (n, C)
                if need_w:
                    grad_w += (g.t() @ x).float()  # (V, C)
                del g
        ctx.save_for_backward(grad_h, grad_w)
        return total / count  # all rows ignored: 0 / 0, nan, as F.cross_entropy's

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors  # out of place: a second backward (retain_graph) finds them intact
        grad_h = None if grad_h is None else (grad_h * grad_loss).to(grad_h.dtype)
        grad_w = None if grad_w is None else grad_w * grad_loss
        return grad_h, grad_w, None, None, None, None, None
