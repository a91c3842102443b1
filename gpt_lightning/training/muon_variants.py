"""Muon's newer steps, each a switch of its own and off by default (then the step is torch's Muon):
Polar Express in place of the quintic Newton-Schulz, NorMuon's per-neuron second moment after it,
and cautious weight decay. Each as nanochat's ``nanochat/optim.py`` (``muon_step_fused``, commit 92d63d4)
takes it (docs/optimizers.md); ``optimizers.muon_matrix_step`` calls them in nanochat's order."""

from __future__ import annotations

import torch

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932): iteration k maps X to
# a_k X + b_k (X X^T) X + c_k (X X^T)^2 X with its own (a_k, b_k, c_k), the odd quintic that best
# pushes the singular values left after iteration k - 1 towards 1. nanochat's ``polar_express_coeffs``
# (computed for num_iters=5, safety_factor=2e-2, cushion=2), as modded-nanogpt uses them.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# NorMuon's second-moment coefficient (arXiv 2510.05491): nanochat's Muon ``beta2`` until its
# commit 6ed7d1d (2026-03-09) lowered it to 0.9 with other retuning.
NORMUON_BETA2 = 0.95
# The second moment of NorMuon's state, named as nanochat names it.
NORMUON_STATE = "second_momentum_buffer"


def polar_express(update: torch.Tensor, steps: int) -> torch.Tensor:
    """``update`` orthogonalized by ``steps`` Polar Express iterations, in bfloat16 (as torch's
    Newton-Schulz runs, and nanochat on a GPU): nanochat's normalization X / (||X||_F x 1.01 + 1e-6),
    then the Gram matrix of the shorter side, X^T X multiplied from the right on a tall matrix,
    X X^T from the left on a wide or square one. Singular values end near 1 (0.85 to 1.15 on a
    random 64 x 32), where the quintic Newton-Schulz leaves them between about 0.68 and 1.13."""
    X = update.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    if update.size(-2) > update.size(-1):  # tall
        for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:steps]:
            A = X.mT @ X
            B = b * A + c * (A @ A)
            X = a * X + X @ B
    else:
        for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:steps]:
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return X


def normuon_state(p: torch.Tensor) -> torch.Tensor:
    """NorMuon's second moment for the matrix ``p``, zero: one entry per neuron of its longer side
    (per row of a tall or square matrix, (rows, 1); per column of a wide one, (1, cols)), as nanochat's."""
    rows, cols = p.shape
    return torch.zeros((rows, 1) if rows >= cols else (1, cols), dtype=p.dtype, device=p.device)


def normuon(
    update: torch.Tensor, second_moment: torch.Tensor, beta2: float, skip: torch.Tensor | None = None
) -> torch.Tensor:
    """NorMuon's variance reduction of an orthogonalized ``update`` (in the weight's dtype), as
    nanochat's ``muon_step_fused``: the mean square of each neuron's entries (along the reduction dim
    of the longer side) into ``second_moment`` (in place, an EMA with ``beta2``), each neuron scaled by
    its 1 / sqrt, then the whole rescaled to the Frobenius norm it had. ``skip`` (0-dim bool) True
    leaves ``second_moment`` as it was (lerp towards itself)."""
    red_dim = -1 if update.size(-2) >= update.size(-1) else -2
    v_mean = update.float().square().mean(dim=red_dim, keepdim=True)
    red_dim_size = update.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red_dim_size).sqrt()
    target = v_mean.to(second_moment.dtype)
    second_moment.lerp_(target if skip is None else torch.where(skip, second_moment, target), 1 - beta2)
    step_size = second_moment.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.float().square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt()
    final_scale = step_size * (v_norm / v_norm_new.clamp_min(1e-10))
    return update * final_scale.to(update.dtype)


def cautious_decay_(p: torch.Tensor, update: torch.Tensor, decay: float, skip: torch.Tensor | None = None) -> None:
    """Cautious weight decay: ``p`` multiplied by 1 - ``decay`` only where the update (subtracted
    next) and the weight agree in sign, so the step shrinks it anyway; nanochat's mask
    ``(g * p) >= 0`` (where either is 0 the decay applies). The factor is torch's Muon's, so where
    every sign agrees this is torch's decay bit for bit. ``skip`` True: no decay anywhere."""
    keep = (update * p) < 0
    if skip is not None:
        keep |= skip
    p.mul_(torch.where(keep, 1.0, 1 - decay))
