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

from gpt_lightning.data import TokenStreamDataModule
from gpt_lightning.generation import generate
from gpt_lightning.training import module as training_module
from gpt_lightning.training.attention import device_attention_backends, training_attention_backends
from gpt_lightning.training.module import GPTLightningModule

FALLBACKS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def hopper(device, *, cudnn_attention=True, **step):
    """``device_attention_backends`` as on a Hopper GPU (cuDNN 9), the module's other arguments kept."""
    return training_attention_backends("cuda", (9, 0), cudnn_attention, **step)


@pytest.mark.parametrize(
    "device_type, capability, cudnn, seq_len, static_graph, expected",
    [
        ("cuda", (9, 0), True, 1024, True, [SDPBackend.CUDNN_ATTENTION, *FALLBACKS]),  # Hopper: H100, H200
        ("cuda", (10, 0), True, 128, False, [SDPBackend.CUDNN_ATTENTION, *FALLBACKS]),  # Blackwell
        ("cuda", (9, 0), False, 1024, True, None),  # cuDNN < 9: no attention in it
        ("cuda", (8, 0), True, 128, True, None),  # Ampere: flash, SDPA's own first choice
        ("cpu", None, False, 128, True, [SDPBackend.MATH]),  # a short compiled CPU step: fused math
        ("cpu", None, False, 129, True, None),  # longer: the flash kernel
        ("cpu", None, False, 128, False, None),  # eager or dynamic: flash (eager math upcasts, keeps (T, T))
    ],
)
def test_the_training_attention_kernel_per_device_and_step(
    device_type, capability, cudnn, seq_len, static_graph, expected
):
    step = {"seq_len": seq_len, "static_graph": static_graph}
    assert training_attention_backends(device_type, capability, cudnn, **step, dtype=torch.bfloat16) == expected
    if device_type == "cpu":  # float32: even with flash, for a longer cold compile
        assert training_attention_backends(device_type, capability, cudnn, **step, dtype=torch.float32) is None


@pytest.mark.parametrize("cudnn_attention", [True, False])
def test_the_module_s_switch_reaches_a_hopper_gpu_s_order(cudnn_attention, monkeypatch):
    """``device_attention_backends`` itself on a stood-in Hopper with cuDNN 9: the switch decides."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    backends = device_attention_backends(torch.device("cuda", 0), seq_len=1024, cudnn_attention=cudnn_attention)
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
    module = GPTLightningModule(n_layer=2, n_head=2, n_embd=32, block_size=16, compile=False)
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
    """A plain Trainer's step on a stood-in Hopper GPU: ``cudnn_attention`` (on by default) puts cuDNN's
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


@pytest.mark.parametrize(
    "settings, static_graph",
    [
        ({"compile": True}, True),
        ({"compile": False}, False),  # eager
        ({"compile": True, "activation_checkpointing": True}, False),  # the recompute runs outside the context
        ({"compile": True, "compile_dynamic": None}, False),  # a graph that may serve other lengths
    ],
)
def test_only_a_graph_for_the_step_s_length_alone_asks_for_the_cpu_s_math(settings, static_graph, monkeypatch):
    """What the module's step tells ``device_attention_backends`` (its run stood in for, eager)."""
    asked = []
    monkeypatch.setattr(training_module, "device_attention_backends", lambda device, **kw: asked.append(kw))
    monkeypatch.setattr(GPTLightningModule, "is_compiled", property(lambda self: settings["compile"]))
    module = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, block_size=16, **settings)
    idx = torch.randint(0, 50257, (2, 16))
    module.training_step((idx, idx), 0)
    assert asked == [{"seq_len": 16, "static_graph": static_graph, "dtype": torch.float32, "cudnn_attention": True}]


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
