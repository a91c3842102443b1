"""Weights about to be replaced or sharded are never built at random first: loaders build the GPT on
the meta device and take the checkpoint's tensors (no random numbers drawn, the LM head still tied),
and under ModelParallelStrategy the CLI builds the model empty, shards it, then gives each rank its
shard with the values an eager build from the same seed has."""

import pytest
import torch
from conftest import REPO, TINY_CPU, tiny_flags
from lightning.pytorch import Callback, seed_everything

from gpt_lightning import GPTLightningModule
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.interop.pretrained import export_hf, gpt_from_hf
from gpt_lightning.interop.weights import export_weights, load_gpt
from gpt_lightning.lightning_cli import GPTLightningCLI
from gpt_lightning.model import GPT, GPTConfig

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One tiny trained-shaped GPT written three ways: a .ckpt, exported safetensors, a Hugging Face directory."""
    root = tmp_path_factory.mktemp("meta")
    torch.manual_seed(0)
    module = GPTLightningModule(**TINY, compile=False)
    ckpt = root / "model.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpt)
    export_weights(ckpt, root / "model.safetensors")
    export_hf(module.model, root / "hf")
    return module.model.state_dict(), ckpt, root


@pytest.mark.parametrize(
    "load",
    [
        lambda root: gpt_from_checkpoint(root / "model.ckpt"),
        lambda root: load_gpt(root / "model.safetensors"),
        lambda root: gpt_from_hf(str(root / "hf")),
        lambda root: GPTLightningModule(init_from=str(root / "hf"), compile=False).model,
    ],
    ids=["checkpoint", "safetensors", "hugging-face", "init_from"],
)
def test_loading_draws_no_random_numbers_and_keeps_the_head_tied(saved, load):
    expected, _, root = saved
    before = torch.random.get_rng_state()
    model = load(root)
    assert torch.equal(torch.random.get_rng_state(), before)  # nothing built at random first
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == len(list(GPT(GPTConfig(**TINY)).parameters()))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_an_eager_build_and_a_meta_build_initialized_later_are_identical():
    torch.manual_seed(0)
    eager = GPT(GPTConfig(**TINY))
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        empty = GPT(GPTConfig(**TINY))
    torch.rand(100)  # whatever runs in between
    empty.to_empty(device="cpu")  # unties the head: each module gets a Parameter of its own
    empty.init_weights(torch.Generator().set_state(state))  # ties it again
    assert empty.lm_head.weight is empty.transformer.wte.weight
    assert empty.num_parameters() == eager.num_parameters()
    for name, tensor in eager.state_dict().items():
        assert torch.equal(tensor, empty.state_dict()[name]), name


class FirstWeights(Callback):
    """Where the model was built, and its whole weights once configure_model has materialized them."""

    def setup(self, trainer, pl_module, stage):
        self.built_on = pl_module.model.transformer.wte.weight.device.type  # before configure_model

    def on_fit_start(self, trainer, pl_module):
        self.weights = {k: v.full_tensor().clone() for k, v in pl_module.model.state_dict().items()}


def test_model_parallel_builds_empty_then_starts_from_the_eager_weights(small_text, tmp_path, in_process_group):
    cli = GPTLightningCLI(
        run=False,
        args=[
            "--config",
            TINY_CPU,
            "--config",
            str(REPO / "configs" / "fsdp2.yaml"),
            "--trainer.devices",
            "1",
            *tiny_flags(
                {
                    "data.block_size": 32,
                    "data.data_path": small_text,
                    "trainer.max_steps": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ],
    )
    probe = FirstWeights()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert probe.built_on == "meta"
    seed_everything(42)  # the CLI's seed
    eager = GPTLightningModule(**TINY, compile=False).model.state_dict()
    assert probe.weights.keys() == eager.keys()
    for name, tensor in eager.items():
        assert torch.equal(probe.weights[name], tensor), name


class NanoGPT(torch.nn.Module):
    """The reference script's build, in its order: every layer made eagerly on the CPU (each with
    torch's own default initialization), the head tied, then GPT-2's init by ``apply``."""

    def __init__(self, config):
        super().__init__()
        nn, C = torch.nn, config.n_embd

        def block():
            b = nn.Module()
            b.ln_1, b.attn, b.ln_2, b.mlp = nn.LayerNorm(C), nn.Module(), nn.LayerNorm(C), nn.Module()
            b.attn.c_attn, b.attn.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            b.mlp.c_fc, b.mlp.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            b.attn.c_proj.SCALE = b.mlp.c_proj.SCALE = 1
            return b

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, C),
                wpe=nn.Embedding(config.block_size, C),
                h=nn.ModuleList(block() for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(C),
            )
        )
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(lambda m: self._init(m, config.n_layer))

    @staticmethod
    def _init(module, n_layer):
        if isinstance(module, torch.nn.Linear):
            std = 0.02 * (2 * n_layer) ** -0.5 if hasattr(module, "SCALE") else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


def test_a_seed_gives_the_weights_the_reference_scripts_build_gives():
    """torch.manual_seed(42); GPT(GPTConfig()) starts where the reference script's model starts
    (its step-0 loss 10.999393): the layers' default draws first, then GPT-2's init. The meta build
    materialized later (FSDP2's path, above) gives these same weights."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=500)
    torch.manual_seed(42)
    reference = NanoGPT(config).state_dict()
    torch.manual_seed(42)
    ours = GPT(config).state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    torch.manual_seed(42)
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        empty = GPT(config)
    empty.to_empty(device="cpu")
    empty.init_weights(torch.Generator().set_state(state))
    for name, tensor in reference.items():
        assert torch.equal(empty.state_dict()[name], tensor), name
