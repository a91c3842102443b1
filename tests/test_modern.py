"""The modern switches (docs/modern.md): GPT-2 is untouched by them, and with them on the model
compiles without graph breaks, samples from its cache what its forward gives, counts its FLOPs,
groups its parameters for Muon (value embeddings with the embeddings) and exports to safetensors (and not to Hugging Face GPT-2)."""

import dataclasses
import hashlib
import math
import warnings

import pytest
import torch
import torch._dynamo
from conftest import REPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_readme import README

from gpt_lightning.cli import main
from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.continuations import score_continuations
from gpt_lightning.generation import generate
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.interop.pretrained import export_hf
from gpt_lightning.interop.weights import load_gpt
from gpt_lightning.model import GPT, VALUE_GATE_CHANNELS, GPTConfig, KVCache, flex_window, modern_switches_on
from gpt_lightning.scaling.flops import training_flops
from gpt_lightning.training.optimizers import build_optimizer, group_settings

SHAPE = dict(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=32)
MODERN = GPTConfig(
    **SHAPE,
    bias=False,
    rotary=True,
    norm="rmsnorm",
    norm_affine=False,
    qk_norm=True,
    activation="relu2",
    tie_embeddings=False,
    zero_init_proj=True,
    logit_softcap=15.0,
    value_embeddings=True,
    window_pattern="SL",  # block 0 sees 4 positions back (block_size 16 / 4), block 1 (the last) all
)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for key, value in model.state_dict().items():
        h.update(key.encode() + value.numpy().tobytes())
    return h.hexdigest()


def test_gpt2_s_seeded_weights_and_size_are_those_before_the_switches():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=100))
    # Hashed on the code before the switches were added (commit a25052a).
    assert digest(model) == "ec5e077834f25a8fc4c71b27b25a8e4671fc58bc7897dac9e53629602fc1ab65"
    assert model.num_parameters() == 108544


def trained_modern() -> GPT:
    """The modern model with every weight moved off its (partly zero) init, so the tests see all paths."""
    torch.manual_seed(0)
    model = GPT(MODERN)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_the_modern_model_has_its_layers_and_no_others():
    model = GPT(MODERN)
    keys = set(model.state_dict())
    assert "transformer.wpe.weight" not in keys and not any(k.endswith(".bias") for k in keys)
    assert not any(".ln_" in k for k in keys)  # parameter-free RMSNorm
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert all(not model.transformer.h[0].attn.c_proj.weight.any() for _ in [0])  # zero-init projections
    assert not model.lm_head.weight.any()
    logits, _ = trained_modern()(torch.randint(0, 128, (1, 16)))
    assert logits.abs().max() < 15.0  # the softcap


def test_the_softcap_keeps_the_logits_gaps_to_the_cap_under_bf16_autocast():
    """In bf16 a logit near the cap rounds onto it (steps of 0.06 at 15); the softcap runs in float32."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE, logit_softcap=15.0))
    with torch.no_grad():
        model.transformer.wte.weight.mul_(100)  # raw logits out to several times the cap
    idx = torch.randint(0, 128, (2, 16))
    reference = model(idx)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        capped = model(idx)[0]
    assert capped.dtype == torch.float32
    near = reference.abs() > 12  # where tanh is flat, the bf16 head's own rounding hardly shows
    assert near.float().mean() > 0.1
    gap, reference_gap = 15.0 - capped.abs()[near], 15.0 - reference.abs()[near]
    assert ((gap - reference_gap) / reference_gap).abs().max() < 0.05  # bf16 softcap: 1.0 (gaps of 0)


@pytest.mark.parametrize("n_layer, with_value_embedding", [(2, [1]), (3, [0, 2]), (4, [1, 3])])
def test_value_embeddings_are_in_every_other_block_counting_back_from_the_last(n_layer, with_value_embedding):
    model = GPT(GPTConfig(**{**SHAPE, "n_layer": n_layer}, value_embeddings=True))
    attns = [block.attn for block in model.transformer.h]
    assert [i for i, attn in enumerate(attns) if attn.value_embedding is not None] == with_value_embedding
    for i in with_value_embedding:
        assert attns[i].value_embedding.weight.shape == (128, 32) and attns[i].value_gate.weight.shape == (2, 12)
        gate = attns[i].value_gate.weight
        assert 0 <= gate.min() and gate.max() <= 0.02 and gate.std() > 0  # nanochat's U(0, 0.02): gates start at ~1.5
        assert 0.01 < attns[i].value_embedding.weight.std() < 0.03  # drawn as the value weights, N(0, 0.02)
    # They reach the output: zeroing one table changes the logits.
    idx = torch.randint(0, 128, (1, 16))
    before = model(idx)[0]
    with torch.no_grad():
        attns[with_value_embedding[-1]].value_embedding.weight.zero_()
    assert not torch.allclose(model(idx)[0], before)


def test_windowed_attention_is_a_loop_over_each_query_s_last_positions():
    """nanochat's semantics: the pattern tiled over the blocks, the last block long, W = ceil(fraction x
    block_size), a query at i seeing the keys at i - W to i; SDPA with the band (the CPU's path) and flex
    attention's block mask (CUDA's, compiled; run here unfused) both equal a loop over the queries."""
    config = GPTConfig(**{**SHAPE, "n_layer": 5}, window_pattern="SSL")
    assert [config.attention_window(i) for i in range(5)] == [4, 4, None, 4, None]
    windows = [GPTConfig(block_size=T, window_pattern="SSSL").attention_window(0) for T in (64, 128, 1024)]
    assert windows == [16, 32, 256]
    assert GPTConfig(**SHAPE, window_pattern="S", short_window_fraction=0.95).attention_window(0) is None  # reaches 0
    model = trained_modern()
    attn = model.transformer.h[0].attn
    assert attn.window == 4 and model.transformer.h[1].attn.window is None
    x, idx = torch.randn(2, 16, 32), torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        q, k, v = attn.heads(x, idx, torch.arange(16))  # 3 x (B, nh, T, hs)
        rows = []
        for i in range(16):
            seen = slice(max(0, i - 4), i + 1)
            weights = torch.softmax(q[:, :, i : i + 1] @ k[:, :, seen].mT / math.sqrt(16), dim=-1)  # (B, nh, 1, <=5)
            rows.append(weights @ v[:, :, seen])  # (B, nh, 1, hs)
        loop = torch.cat(rows, dim=2)  # (B, nh, T, hs)
        torch.testing.assert_close(attn(x, idx), attn.c_proj(loop.transpose(1, 2).reshape(2, 16, 32)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex attention's "called without torch.compile"
            torch.testing.assert_close(flex_window(q, k, v, 4), loop)
        causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert not torch.allclose(causal[:, :, 5:], loop[:, :, 5:]) and torch.allclose(causal[:, :, :5], loop[:, :, :5])
    # Hugging Face GPT-2 has no window: refused; a pattern of long blocks only is GPT-2's attention.
    assert modern_switches_on(GPTConfig(window_pattern="SSSL")) == ["window_pattern"]
    assert modern_switches_on(GPTConfig(window_pattern="LL")) == []
    with pytest.raises(ValueError, match="window_pattern must be letters S and L"):
        GPTConfig(window_pattern="sssl")
    with pytest.raises(ValueError, match="short_window_fraction must be in"):
        GPTConfig(short_window_fraction=0.0)


def test_the_modern_model_compiles_without_graph_breaks():
    model = GPT(MODERN)
    idx = torch.randint(0, 128, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # compile_scope blocks: each block alone, with a value embedding (block 1) and without (block 0, windowed).
    x = torch.randn(2, 16, 32)
    for block in model.transformer.h:
        explanation = torch._dynamo.explain(block)(x, idx)
        assert explanation.graph_break_count == 0, explanation.break_reasons


def test_greedy_cached_tokens_equal_the_uncached_forward_past_block_size():
    model = trained_modern()
    idx = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = generate(model, idx, 20, temperature=0)  # 25 > block_size 16: the window slides
    assert torch.equal(cached, generate(model, idx, 20, temperature=0, use_cache=False))
    idx = torch.randint(0, 128, (2, 9))
    positions = torch.tensor([3, 17])
    torch.testing.assert_close(model.logits_at(idx, positions), model(idx)[0].reshape(18, -1)[positions])


def test_flops_count_gpt2_s_matmuls_of_the_shape_and_the_value_gates():
    # Rotary, norms, ReLU^2 and the softcap are elementwise: the matmuls, attention's included, are GPT-2's.
    without_value_embeddings = dataclasses.replace(MODERN, value_embeddings=False)
    assert training_flops(without_value_embeddings, 2, 16) == training_flops(GPTConfig(**SHAPE), 2, 16) > 0
    # A value embedding is a lookup, not a matmul; its gate (12 -> n_head, block 1 only) is one: 2 FLOPs
    # per multiply-add forward, twice that backward (input and weight gradients).
    gate = 6 * (2 * 16) * VALUE_GATE_CHANNELS * 2
    assert training_flops(MODERN, 2, 16) == training_flops(without_value_embeddings, 2, 16) + gate


def test_muon_takes_the_blocks_matrices_and_the_embedding_and_head_get_their_own_rates():
    model = GPT(MODERN)
    hparams = dict(
        optimizer="muon",
        learning_rate=1e-3,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        muon_learning_rate=0.02,
        muon_momentum=0.95,
        muon_weight_decay=0.0,
        muon_adjust_lr="original",
        embedding_learning_rate=0.1,
        head_learning_rate=0.004,
        tie_embeddings=False,
    )
    optimizer = build_optimizer(
        model, "muon", fused=None, **{k: v for k, v in hparams.items() if k not in ("optimizer", "tie_embeddings")}
    )
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert list(groups) == ["muon", "embedding", "head", "adamw_no_decay"]
    # The value embedding (block 1) is an embedding: AdamW at the embedding's rate, not Muon.
    value_embedding = model.transformer.h[1].attn.value_embedding.weight
    assert groups["embedding"]["params"] == [model.transformer.wte.weight, value_embedding]
    assert groups["embedding"]["lr"] == 0.1
    assert groups["head"]["params"] == [model.lm_head.weight] and groups["head"]["lr"] == 0.004
    # c_attn, attn.c_proj, c_fc, mlp.c_proj per block, and block 1's value gate (a matrix, Muon's in nanochat)
    assert len(groups["muon"]["params"]) == 4 * 2 + 1
    assert any(p is model.transformer.h[1].attn.value_gate.weight for p in groups["muon"]["params"])
    assert [s["lr"] for s in group_settings(hparams)] == [g["lr"] for g in optimizer.param_groups]
    adamw = build_optimizer(
        model, "adamw", fused=None, **{k: v for k, v in hparams.items() if k not in ("optimizer", "tie_embeddings")}
    )
    assert [s["lr"] for s in group_settings({**hparams, "optimizer": "adamw"})] == [g["lr"] for g in adamw.param_groups]
    assert sum(len(g["params"]) for g in adamw.param_groups) == len(list(model.parameters()))


def test_the_preset_trains_exports_to_safetensors_and_refuses_hf(tmp_path, small_text):
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "modern-tiny-cpu.yaml"),
            "--model.compile",
            "false",
            "--model.n_layer",
            "2",  # the preset's SSSL windows block 0 (the last block is always long)
            "--model.n_head",
            "2",
            "--model.n_embd",
            "32",
            "--data.batch_size",
            "2",
            "--data.block_size",
            "16",
            "--trainer.max_steps",
            "3",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.log_every_n_steps",
            "1",
            "--model.val_sample_tokens",
            "0",
            "--model.short_window_fraction",  # beside the preset's SSSL: both carried by the checkpoint and the export
            "0.5",
            "--data.data_path",
            str(small_text),
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
        ]
    )
    (ckpt,) = tmp_path.glob("modern-tiny-cpu/version_0/checkpoints/last.ckpt")
    events = EventAccumulator(str(ckpt.parent.parent))
    events.Reload()
    rates = sorted(tag for tag in events.Tags()["scalars"] if tag.startswith("lr-"))
    assert rates == [f"lr-MuonWithAdamW/{name}" for name in ("adamw_no_decay", "embedding", "head", "muon")]
    assert "`/muon`, `/embedding`, `/head`, `/adamw_no_decay`" in README  # its TensorBoard table
    model = gpt_from_checkpoint(ckpt).eval()
    assert model.config.rotary and not model.config.tie_embeddings  # recorded in the checkpoint
    assert (model.config.window_pattern, model.config.short_window_fraction) == ("SSSL", 0.5)
    assert model.config.attention_window(0) == 8 and model.config.attention_window(1) is None  # half of T = 16
    assert (
        model.config.value_embeddings and model.transformer.h[-1].attn.value_embedding is not None
    )  # the last block has one
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "w.safetensors")])
    loaded = load_gpt(tmp_path / "w.safetensors").eval()
    assert loaded.config == model.config
    idx = torch.randint(0, 50257, (1, 16))
    torch.testing.assert_close(loaded(idx)[0], model(idx)[0])
    with pytest.raises(UserError, match="--format safetensors"):
        export_hf(model, tmp_path / "hf")


def test_a_switch_with_init_from_or_an_untied_rate_on_a_tied_head_is_refused_in_one_line(tmp_path):
    from gpt_lightning import GPTLightningModule

    # Refused before the Hugging Face weights are read (or, for a hub name, downloaded).
    with pytest.raises(UserError, match="model.init_from loads Hugging Face GPT-2, which has none of model.rotary"):
        GPTLightningModule(init_from=str(tmp_path / "no-such-gpt2"), rotary=True)
    # A rate for the untied embedding would be ignored on GPT-2's tied one.
    with pytest.raises(UserError, match="model.embedding_learning_rate is the rate of an untied"):
        GPTLightningModule(**SHAPE, embedding_learning_rate=0.3)
    with pytest.raises(UserError, match="model.head_learning_rate must be > 0"):
        GPTLightningModule(**SHAPE, tie_embeddings=False, head_learning_rate=0.0)


def test_zero_initialized_projections_alone_still_export_to_hugging_face(tmp_path):
    model = GPT(GPTConfig(**SHAPE, zero_init_proj=True))
    export_hf(model, tmp_path / "hf")  # only the start differs from GPT-2: the layout is GPT-2's
    assert (tmp_path / "hf" / "config.json").is_file()


# nanochat's residual and x0 scalars, the one switch between the blocks.
ARCH_SHAPE = {**SHAPE, "n_layer": 3}


def arch_model(switches: dict) -> GPT:
    """A model with ``switches``, every weight moved off its init, so each path shows in the logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ARCH_SHAPE, **switches))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_the_residual_scalars_start_as_nanochats():
    model = GPT(GPTConfig(**ARCH_SHAPE, residual_scalars=True))
    gpt2 = GPT(GPTConfig(**ARCH_SHAPE))
    scalars = {name: p for name, p in model.named_parameters() if name not in dict(gpt2.named_parameters())}
    starts = {"resid_lambdas": [1.15, 1.10, 1.05], "x0_lambdas": [0.20, 0.125, 0.05]}  # init_weights, n_layer 3
    assert set(scalars) == set(starts)
    for name, value in starts.items():
        torch.testing.assert_close(scalars[name], torch.tensor(value))
    assert modern_switches_on(model.config) == ["residual_scalars"]  # Hugging Face GPT-2 has none
    assert training_flops(model.config, 2, 16) == training_flops(gpt2.config, 2, 16)  # elementwise


@pytest.mark.parametrize(
    "switches",
    [{"residual_scalars": True}, {"window_pattern": "SL"}],
    ids=["residual_scalars", "window"],  # the window: blocks 0 of 3 sees 4 positions back, its scored tokens 4 to 11
)
def test_cached_decoding_logits_at_and_the_harness_scorer_equal_the_forward(switches):
    model = arch_model(switches)
    gpt2_like = arch_model({})
    idx = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.allclose(model(idx)[0], gpt2_like(idx)[0], atol=1e-3)  # the switch shows
        for length in (6, None):  # decode steps with the cache's length, and masked (a compiled step's)
            caches = [KVCache(16) for _ in model.transformer.h]
            torch.testing.assert_close(
                model.forward_cached(idx[:, :6], caches, torch.arange(6)), model(idx[:, :6])[0][:, -1]
            )
            for t in range(6, 12):
                step = model.forward_cached(
                    idx[:, t : t + 1], caches, torch.tensor([t]), None if length is None else t + 1
                )
                torch.testing.assert_close(step, model(idx[:, : t + 1])[0][:, -1])
        caches = [KVCache(16) for _ in model.transformer.h]  # a one-token prompt
        torch.testing.assert_close(
            model.forward_cached(idx[:, :1], caches, torch.arange(1)), model(idx[:, :1])[0][:, -1]
        )
        # Past block_size the window slides and its prefill starts a sequence again: as the windowed reference.
        from test_generate import windowed_reference

        prompt = idx[:, :5]
        assert torch.equal(generate(model, prompt, 20, temperature=0), windowed_reference(model, prompt, 20))
        positions = torch.tensor([0, 5, 17, 23])
        torch.testing.assert_close(model.logits_at(idx, positions), model(idx)[0].reshape(24, -1)[positions])
        requests = [
            (idx[0, :4].tolist(), idx[0, 4:9].tolist()),
            (idx[0, :4].tolist(), idx[1, :1].tolist()),
            (idx[1, :7].tolist(), idx[1, 7:12].tolist()),
        ]
        scored = score_continuations(model, requests, 4, torch.device("cpu"))
        for (context, ending), (logprob, _) in zip(requests, scored):
            whole = torch.tensor([context + ending])
            logprobs = torch.log_softmax(model(whole[:, :-1])[0][0], dim=-1)[-len(ending) :]
            assert logprob == pytest.approx(logprobs.gather(1, whole[0, -len(ending) :, None]).sum().item(), abs=1e-4)


def test_the_residual_scalars_compile_without_graph_breaks():
    model = arch_model({"residual_scalars": True})
    idx = torch.randint(0, 128, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    x = torch.randn(2, 16, 32)  # compile_scope blocks: the blocks are unchanged, the scalars act between them
    assert torch._dynamo.explain(model.transformer.h[0])(x, idx).graph_break_count == 0


def test_the_scalars_train_with_adamw_without_decay_and_never_with_muon(tmp_path):
    model = GPT(dataclasses.replace(MODERN, residual_scalars=True))
    scalars = [model.resid_lambdas, model.x0_lambdas]
    options = dict(learning_rate=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=None)
    muon = dict(muon_learning_rate=0.02, muon_momentum=0.95, muon_weight_decay=0.0, muon_adjust_lr="original")
    groups = {g["name"]: g for g in build_optimizer(model, "muon", **options, **muon).param_groups}
    assert list(groups) == ["muon", "embedding", "head", "adamw_no_decay"]  # no group of their own
    no_decay = {id(p) for p in groups["adamw_no_decay"]["params"]}
    assert all(id(p) in no_decay for p in scalars) and groups["adamw_no_decay"]["weight_decay"] == 0.0
    # Checkpointed, exported to safetensors and loaded back, with their values.
    from gpt_lightning import GPTLightningModule

    module = GPTLightningModule(**ARCH_SHAPE, compile=False, residual_scalars=True)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "a.ckpt")
    main(["export", "--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "w.safetensors")])
    loaded = load_gpt(tmp_path / "w.safetensors").eval()
    assert loaded.config == module.model.config
    idx = torch.randint(0, 128, (1, 16))
    torch.testing.assert_close(loaded(idx)[0], module.model.eval()(idx)[0])
    with pytest.raises(UserError, match="--format safetensors"):
        export_hf(loaded, tmp_path / "hf")
