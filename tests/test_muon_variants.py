"""Muon's newer steps (``--model.muon_normuon``, ``--model.muon_cautious_weight_decay``) against nanochat's ``nanochat/optim.py`` written out here as it
is there; with them on, the guarded step still skips everything on the device, the state resumes
exactly, a resume re-applies them, the CLI trains with them, and they are refused where meaningless."""

import copy

import pytest
import torch
from conftest import TINY_MODEL
from test_optimizers import TINY_CPU, built

from gpt_lightning.cli import main
from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import muon_math
from gpt_lightning.training import resume
from gpt_lightning.training.module import GPTLightningModule
from gpt_lightning.training.muon_variants import NORMUON_STATE
from gpt_lightning.training.optimizers import group_settings, muon_matrix_step

SWITCHES = dict(
    optimizer="muon",
    muon_weight_decay=0.1,
    muon_normuon=True,
    muon_cautious_weight_decay=True,
)

# torch's Muon's Newton-Schulz coefficients (the orthogonalization this package's Muon runs).
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)


def nanochat_muon_step(grads, params, momentum_buffer, second_momentum_buffer, momentum, lr, wd, beta2, decay_lr):
    """nanochat/optim.py's muon_step_fused for one matrix, as written there, less MuonEq's row equilibration and
    Muon+'s renormalization (no switches here), with torch's Newton-Schulz in place of its Polar Express (this
    package's orthogonalization); ``decay_lr``: nanochat decays by its (shape-adjusted) ``lr``, torch's Muon by the
    group's rate."""
    red_dim = -1 if params.shape[-2] >= params.shape[-1] else -2
    momentum = torch.tensor(momentum).to(grads.dtype)
    momentum_buffer.lerp_(grads, 1 - momentum)
    g = grads.lerp_(momentum_buffer, momentum)
    g = muon_math()[0](g, NS_COEFFICIENTS, 5, 1e-7).to(params.dtype)
    beta2 = torch.tensor(beta2).to(g.dtype)
    v_mean = g.float().square().mean(dim=red_dim, keepdim=True)
    red_dim_size = g.size(red_dim)
    v_norm_sq = v_mean.sum(dim=(-2, -1), keepdim=True) * red_dim_size
    v_norm = v_norm_sq.sqrt()
    second_momentum_buffer.lerp_(v_mean.to(dtype=second_momentum_buffer.dtype), 1 - beta2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.float().square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt()
    final_scale = step_size * (v_norm / v_norm_new.clamp_min(1e-10))
    g = g * final_scale.to(g.dtype)
    mask = (g * params) >= 0
    params.sub_(lr * g + decay_lr * wd * params * mask)


def muon_group(**switches):
    """A Muon parameter group as build_optimizer makes it (torch.optim.Muon's defaults), ``switches`` on."""
    group = dict(lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_coefficients=NS_COEFFICIENTS)
    group.update(ns_steps=5, eps=1e-7, adjust_lr_fn="original")
    return {**group, "normuon": False, "cautious_weight_decay": False, **switches}


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)], ids=["tall", "wide"])
def test_two_steps_with_every_switch_are_nanochat_s(shape):
    """NorMuon's second moment (one per row of a tall matrix, per column of a wide one) and cautious
    weight decay: two steps equal nanochat's fused step's to float32 rounding."""
    torch.manual_seed(0)
    p = torch.randn(shape)
    ref_p, ref_buf = p.clone(), torch.zeros(shape)
    ref_second = torch.zeros((shape[0], 1) if shape[0] >= shape[1] else (1, shape[1]))
    group, state = (
        muon_group(weight_decay=0.5, normuon=True, cautious_weight_decay=True),
        {},
    )
    adjusted = group["lr"] * max(1, shape[0] / shape[1]) ** 0.5  # torch's "original", nanochat's own
    for _ in range(2):
        grad = torch.randn(shape)
        p.grad = grad.clone()
        muon_matrix_step(p, group, state)
        nanochat_muon_step(grad, ref_p, ref_buf, ref_second, 0.95, adjusted, 0.5, 0.95, decay_lr=group["lr"])
    assert state[NORMUON_STATE].shape == ref_second.shape
    torch.testing.assert_close(state[NORMUON_STATE], ref_second, rtol=1e-5, atol=0)
    torch.testing.assert_close(state["momentum_buffer"], ref_buf, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6)


def test_cautious_weight_decay_decays_only_where_update_and_weight_agree_in_sign():
    torch.manual_seed(0)
    p0, grad = torch.randn(32, 16), torch.randn(32, 16)

    def stepped(**settings):
        p = p0.clone()
        p.grad = grad.clone()
        muon_matrix_step(p, muon_group(**settings), {})
        return p

    zeropower, _ = muon_math()  # the first step's update, as torch's Muon makes it
    buf = torch.zeros_like(grad).lerp_(grad, 1 - 0.95)
    update = zeropower(grad.lerp(buf, 0.95), NS_COEFFICIENTS, 5, 1e-7)
    differ = (update.float() * p0) < 0  # sign(update) != sign(weight)
    assert 0.2 < differ.float().mean() < 0.8
    none, plain = stepped(), stepped(weight_decay=0.5)
    cautious = stepped(weight_decay=0.5, cautious_weight_decay=True)
    assert (none != plain).all()  # decay shows everywhere
    assert torch.equal(cautious[differ], none[differ]) and torch.equal(cautious[~differ], plain[~differ])


def guarded_step(module, optimizer, seed, found_inf=0.0):
    torch.manual_seed(seed)
    x = torch.randint(0, 50257, (2, 16))
    module(x, x)[1].backward()
    optimizer.found_inf = None if found_inf is None else torch.tensor(found_inf)
    optimizer.step()
    optimizer.zero_grad()


def test_the_guarded_step_with_the_switches_is_their_unguarded_step_bit_for_bit():
    """found_inf 0 gates by exactly 1; found_inf None (no guard: a non-fused AdamW) must not fall
    back on torch's Muon, which knows none of the switches."""

    def run(found_inf, **switches):
        torch.manual_seed(0)
        module = GPTLightningModule(**TINY_MODEL, optimizer="muon", muon_weight_decay=0.1, **switches)
        optimizer = built(module)
        for seed in range(2):
            guarded_step(module, optimizer, seed, found_inf)
        return module.state_dict()

    on = {k: v for k, v in SWITCHES.items() if k not in ("optimizer", "muon_weight_decay")}
    guarded, unguarded, plain = run(0.0, **on), run(None, **on), run(None)
    assert all(torch.equal(a, b) for a, b in zip(guarded.values(), unguarded.values()))
    assert not torch.equal(
        unguarded["model.transformer.h.0.mlp.c_fc.weight"], plain["model.transformer.h.0.mlp.c_fc.weight"]
    )


def test_the_normuon_state_resumes_exactly_and_the_switches_are_re_applied():
    """Two steps, against one step, the state saved and loaded into a fresh optimizer, one step: equal
    bit for bit. A checkpoint's groups from before the switches take the ones built; a resumed run
    re-applies the ones given now (``group_settings``)."""
    torch.manual_seed(0)
    first = GPTLightningModule(**TINY_MODEL, **SWITCHES)
    optimizer = built(first)
    guarded_step(first, optimizer, 1)
    saved = copy.deepcopy(optimizer.state_dict())
    assert all(NORMUON_STATE in saved["state"][k] for k in range(8))  # the Muon matrices come first
    second = copy.deepcopy(first)
    restored = built(second)
    restored.load_state_dict(copy.deepcopy(saved))
    guarded_step(first, optimizer, 2)
    guarded_step(second, restored, 2)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    for key, state in optimizer.state_dict()["state"].items():
        assert all(torch.equal(v, restored.state_dict()["state"][key][k]) for k, v in state.items()), key

    older = copy.deepcopy(saved)
    for key in ("normuon", "cautious_weight_decay"):
        del older["param_groups"][0][key]
    older["param_groups"][0]["orthogonalizer"] = "newton_schulz"  # a removed switch's key, in older checkpoints
    restored.load_state_dict(older)
    assert restored.param_groups[0]["normuon"] and restored.muon.param_groups[0]["cautious_weight_decay"]
    assert "orthogonalizer" not in restored.param_groups[0]
    off = GPTLightningModule(**TINY_MODEL, optimizer="muon")
    resume.apply_optimizer_settings(restored, group_settings(off.hparams))
    assert not restored.param_groups[0]["normuon"] and not restored.param_groups[0]["cautious_weight_decay"]


def test_the_cli_trains_with_every_switch_and_checkpoints_the_second_moment(small_text, tmp_path):
    main(
        [
            "fit",
            *TINY_CPU,
            "--data.data_path",
            str(small_text),
            "--trainer.max_steps",
            "3",
            "--model.optimizer",
            "muon",
            "--model.muon_weight_decay",
            "0.1",
            "--model.muon_normuon",
            "true",
            "--model.muon_cautious_weight_decay",
            "true",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
        ]
    )
    (ckpt,) = tmp_path.glob("tiny-cpu/version_0/checkpoints/last.ckpt")
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert {k: saved["hyper_parameters"][k] for k in SWITCHES} == SWITCHES
    optimizer = saved["optimizer_states"][0]
    assert optimizer["param_groups"][0]["normuon"] and optimizer["param_groups"][0]["cautious_weight_decay"]
    assert optimizer["state"][0][NORMUON_STATE].shape == (96, 1)  # c_attn of width 32: one per row
    assert all(torch.isfinite(w).all() for w in saved["state_dict"].values())


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(muon_normuon=True),
            "model.muon_normuon is a setting of Muon's step; this run trains with model.optimizer adamw",
        ),
        (dict(muon_cautious_weight_decay=True), "model.muon_cautious_weight_decay is a setting of Muon's step"),
        (
            dict(optimizer="muon", muon_cautious_weight_decay=True),
            "model.muon_cautious_weight_decay masks Muon's weight decay, and model.muon_weight_decay is 0.0",
        ),
    ],
    ids=["normuon-adamw", "cautious-adamw", "cautious-without-decay"],
)
def test_a_switch_that_would_do_nothing_is_refused_in_one_line(options, message):
    with pytest.raises(UserError, match=message) as caught:
        GPTLightningModule(**TINY_MODEL, **options)
    assert "\n" not in str(caught.value)
