"""AdamW ("adamw"), or Muon on the blocks' matrices with AdamW on the rest ("muon") as one
``torch.optim.Optimizer``, so Lightning sees one (docs/optimizers.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import muon_math
from gpt_lightning.model import SCALAR_PARAMETERS


def is_embedding(name: str) -> bool:
    """Whether ``name`` is an input embedding table (token, position or a block's value embedding)."""
    return name.startswith(("transformer.wte.", "transformer.wpe.")) or ".attn.value_embedding." in name


def is_head(name: str) -> bool:
    return name.startswith("lm_head.")


def is_scalar(name: str, param: torch.Tensor) -> bool:
    """Whether AdamW updates ``param`` without weight decay: a vector or one of ``SCALAR_PARAMETERS``."""
    return param.dim() < 2 or name in SCALAR_PARAMETERS


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates ``param``: a 2-D weight inside a block that is not an embedding."""
    return name.startswith("transformer.h.") and param.dim() == 2 and not is_embedding(name)


def require_muon() -> None:
    if not hasattr(torch.optim, "Muon"):
        raise UserError(
            f"model.optimizer muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}. "
            "Upgrade torch or use --model.optimizer adamw."
        )


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon(muon_groups, **muon)`` and ``torch.optim.AdamW(adamw_groups, **adamw)`` stepped
    together as one optimizer, so Lightning sees one; ``found_inf`` skips the update on the device."""

    def __init__(
        self, muon_groups: list[dict], adamw_groups: list[dict], muon: dict[str, Any], adamw: dict[str, Any]
    ) -> None:
        require_muon()
        self.muon = torch.optim.Muon(muon_groups, **muon)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={})
        self.found_inf: torch.Tensor | None = None  # set by the NonFiniteGuard before each step
        self._share_with_parts()

    def _share_with_parts(self) -> None:
        # The parts step the very group dicts and state this optimizer saves, loads and schedules.
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state: share them again
        self._share_with_parts()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning's closure: forward, backward, the guard, clipping
            with torch.enable_grad():
                loss = closure()
        skip = self.found_inf
        if skip is None:
            self.muon.step()
        else:
            for group in self.muon.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        muon_matrix_step(p, group, self.state[p], skip.bool())
        self.adamw.found_inf = skip  # fused AdamW skips on the device; None: no guard
        self.adamw.step()
        return loss


def muon_matrix_step(p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], skip: torch.Tensor) -> None:
    """One matrix's Muon step, torch's ``_single_tensor_muon`` bit for bit, with no host read; ``skip`` (a
    0-dim bool tensor) True leaves the weights and momentum as they were."""
    zeropower_via_newtonschulz, adjust_lr = muon_math()  # torch's own Muon math
    lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
    if "momentum_buffer" not in state:  # once, as torch's _init_group does
        state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    grad = torch.where(skip, buf, p.grad)  # skipped: buf, so nothing non-finite gets in
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    update = zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
    update.mul_((~skip).to(update.dtype))  # finite: grad is buf where skipped
    if weight_decay:  # torch's own product (any dtype), kept where skipped
        torch.where(skip, p, p * (1 - lr * weight_decay), out=p)
    p.add_(update, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def parameter_groups(model: nn.Module, hp: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``model``'s trainable parameters in the optimizer's groups, each with its peak settings from
    ``GPTLightningModule``'s options ``hp``: what ``build_optimizer`` builds and a resumed run re-applies."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    untied = any(is_head(name) for name, _ in named)  # a tied head is named transformer.wte.weight only
    rest = [(name, p) for name, p in named if not (untied and (is_embedding(name) or is_head(name)))]
    adamw = {"lr": hp["learning_rate"], "betas": tuple(hp["betas"]), "eps": hp["eps"]}
    own = [
        {
            "name": group,
            "params": [p for name, p in named if is_own(name)],
            **adamw,
            "weight_decay": 0.0,
            **({} if hp.get(f"{group}_learning_rate") is None else {"lr": hp[f"{group}_learning_rate"]}),
        }
        for group, is_own in (("embedding", is_embedding), ("head", is_head))
        if untied
    ]
    vectors = {"params": [p for name, p in rest if is_scalar(name, p)], **adamw, "weight_decay": 0.0}
    decayed = {"params": [p for name, p in rest if not is_scalar(name, p)], **adamw, "weight_decay": hp["weight_decay"]}
    if hp["optimizer"] == "adamw":
        return [decayed, *own, vectors]
    muon = {
        "name": "muon",
        "params": [p for name, p in rest if is_hidden_matrix(name, p)],
        "lr": hp["muon_learning_rate"],
        "momentum": hp["muon_momentum"],
        "weight_decay": hp["muon_weight_decay"],
        "adjust_lr_fn": hp["muon_adjust_lr"],
    }
    decayed["params"] = [p for name, p in rest if not is_hidden_matrix(name, p) and not is_scalar(name, p)]
    return [muon, *(own or [{"name": "adamw", **decayed}]), {"name": "adamw_no_decay", **vectors}]


def build_optimizer(model: nn.Module, hp: Mapping[str, Any], fused: bool | None) -> torch.optim.Optimizer:
    """The optimizer of ``hp["optimizer"]`` ("adamw" or "muon") over ``parameter_groups(model, hp)``."""
    groups = parameter_groups(model, hp)
    if hp["optimizer"] == "adamw":
        return torch.optim.AdamW(groups, fused=fused)
    return MuonWithAdamW(groups[:1], groups[1:], muon=dict(nesterov=True, ns_steps=5), adamw=dict(fused=fused))


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    lr_schedule: str,
    cosine_decay_steps: int | None,
    decay_fraction: float,
    min_lr_ratio: float,
    total_steps: int | None,
) -> float:
    """The learning rate at ``step`` as a fraction of the peak (``GPTLightningModule``'s options)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if lr_schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * total_steps))
        progress = min(1.0, max(0.0, (step - (total_steps - decay_steps)) / decay_steps))
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if cosine_decay_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / cosine_decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
