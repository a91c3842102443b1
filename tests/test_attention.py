"""The training forward's attention kernel: cuDNN's first where the GPU has it, decode never on it."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ONE_QUIET_CPU_STEP
from lightning.pytorch import Trainer
from torch.nn.attention import SDPBackend

from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.generation import generate
from gpt_lightning.training import module as training_module
from gpt_lightning.training.attention import device_attention_backends, training_attention_backends
from gpt_lightning.training.module import GPTLightningModule

FALLBACKS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def hopper(device, *, cudnn_attention=True):
    """``device_attention_backends`` as on a Hopper GPU (cuDNN 9)."""
    return training_attention_backends("cuda", (9, 0), cudnn_attention)


@pytest.mark.parametrize(
    "device_type, capability, cudnn, expected",
    [
        ("cuda", (9, 0), True, [SDPBackend.CUDNN_ATTENTION, *FALLBACKS]),  # Hopper: H100, H200
        ("cuda", (10, 0), True, [SDPBackend.CUDNN_ATTENTION, *FALLBACKS]),  # Blackwell
        ("cuda", (9, 0), False, None),  # cuDNN < 9, or not asked for: SDPA's own order
        ("cuda", (8, 0), True, None),  # Ampere: flash, SDPA's own first choice
        ("cpu", None, True, None),  # a CPU: SDPA's own choice (flash)
    ],
)
def test_the_training_attention_kernel_per_device(device_type, capability, cudnn, expected):
    assert training_attention_backends(device_type, capability, cudnn) == expected
    assert device_attention_backends(torch.device("cpu"), cudnn_attention=True) is None


@pytest.mark.parametrize("cudnn_attention", [True, False])
def test_the_module_s_switch_reaches_a_hopper_gpu_s_order(cudnn_attention, monkeypatch):
    """``device_attention_backends`` itself on a stood-in Hopper with cuDNN 9: the switch decides."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    backends = device_attention_backends(torch.device("cuda", 0), cudnn_attention=cudnn_attention)
    assert backends == ([SDPBackend.CUDNN_ATTENTION, *FALLBACKS] if cudnn_attention else None)


def test_the_training_forward_runs_in_the_chosen_order_and_decode_does_not(monkeypatch):
    """On a CPU the order a Hopper GPU gets is stood in for; each SDPA call records the priority
    order it ran under."""
    monkeypatch.setattr(training_module, "device_attention_backends", hopper)
    orders, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        orders.append(torch._C._get_sdp_priority_order()[0])  # the backend tried first
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    module = GPTLightningModule(n_layer=2, n_head=2, n_embd=32, block_size=16, compile=False, cudnn_attention=True)
    idx = torch.randint(0, 50257, (2, 16))
    module.training_step((idx, idx), 0).backward()
    assert orders == [int(SDPBackend.CUDNN_ATTENTION)] * 2  # both blocks
    default = torch._C._get_sdp_priority_order()[0]
    assert default != int(SDPBackend.CUDNN_ATTENTION)  # restored after the step
    orders.clear()
    generate(module.model.eval(), idx[:, :4], 3)  # prefill and decode: SDPA's own order
    assert orders and set(orders) == {default}


@pytest.mark.parametrize("cudnn_attention", [True, False])
def test_cudnn_attention_is_the_module_s_switch(cudnn_attention, monkeypatch, small_text, tmp_path):
    """A plain Trainer's step on a stood-in Hopper GPU: ``cudnn_attention`` (off by default) puts cuDNN's
    kernel first; off, the training forward keeps SDPA's own order, as on any other device."""
    monkeypatch.setattr(training_module, "device_attention_backends", hopper)
    orders, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        orders.append(torch._C._get_sdp_priority_order()[0])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    default = torch._C._get_sdp_priority_order()[0]
    module = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, compile=False, cudnn_attention=cudnn_attention)
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=16, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    trainer = Trainer(**ONE_QUIET_CPU_STEP)
    trainer.fit(module, data)
    assert orders == [int(SDPBackend.CUDNN_ATTENTION) if cudnn_attention else default]


def test_a_gpu_s_defaults_are_the_path_a_gpu_measured_and_a_cpu_keeps_its_own():
    """On CUDA the defaults are what a GPU run measured (the loss over all the logits, SDPA's own kernel
    order); the chunked loss and cuDNN attention are one option away. A CPU keeps its chunked loss."""
    default = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, compile=False)
    assert not default.uses_chunked_loss(torch.device("cuda")) and default.uses_chunked_loss(torch.device("cpu"))
    assert hopper(None, cudnn_attention=default.hparams.cudnn_attention) is None
    chosen = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, compile=False, chunked_loss=True, cudnn_attention=True)
    assert chosen.uses_chunked_loss(torch.device("cuda"))
    assert hopper(None, cudnn_attention=chosen.hparams.cudnn_attention)[0] == SDPBackend.CUDNN_ATTENTION
    unchunked = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, compile=False, chunked_loss=False)
    assert not unchunked.uses_chunked_loss(torch.device("cpu"))


def test_the_module_s_step_asks_for_its_switch_s_kernel_order(monkeypatch):
    """What the module's step tells ``device_attention_backends``: its ``cudnn_attention`` switch."""
    asked = []
    monkeypatch.setattr(training_module, "device_attention_backends", lambda device, **kw: asked.append(kw))
    module = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, block_size=16, compile=False)
    idx = torch.randint(0, 50257, (2, 16))
    module.training_step((idx, idx), 0)
    assert asked == [{"cudnn_attention": False}]


COMPILED_ATTENTION = """
import sys
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend
from gpt_lightning.training.attention import attention_context

q = torch.randn(1, 2, 8, 16, requires_grad=True)
step = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum())
with attention_context([SDPBackend.MATH] if sys.argv[1] == "math" else None):
    loss = step(q)
loss.backward()
print(counters["aot_autograd"]["autograd_cache_saved"], counters["aot_autograd"]["autograd_cache_hit"])
"""


def test_a_warm_compile_cache_does_not_replay_another_attention_choice(tmp_path):
    """inductor's caches do not key on SDPA's backends: the choice is in the key through our tag, so a
    run with the module's default order never reuses a graph compiled under another (and back)."""

    def compiled(choice: str) -> tuple[int, int]:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [sys.executable, "-c", COMPILED_ATTENTION, choice], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        saved, hit = map(int, done.stdout.split())
        return saved, hit

    assert compiled("math") == (1, 0)  # compiled and saved under math attention: the cache is on
    assert compiled("default") == (1, 0)  # SDPA's own order: compiled again, not math's graph replayed
