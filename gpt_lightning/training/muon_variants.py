"""Muon's newer steps, each a switch of its own and off by default (then the step is torch's Muon):
NorMuon's per-neuron second moment after the orthogonalization, and cautious weight decay. Each as
nanochat's ``nanochat/optim.py`` (``muon_step_fused``, commit 92d63d4) takes it (docs/optimizers.md);
``optimizers.muon_matrix_step`` calls them in nanochat's order."""

from __future__ import annotations

import torch

# NorMuon's second-moment coefficient (arXiv 2510.05491): nanochat's Muon ``beta2`` until its
# commit 6ed7d1d (2026-03-09) lowered it to 0.9 with other retuning.
NORMUON_BETA2 = 0.95
# The second moment of NorMuon's state, named as nanochat names it.
NORMUON_STATE = "second_momentum_buffer"


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
