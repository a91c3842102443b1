"""Checks that need a CUDA GPU. They skip cleanly without one; benchmarks/gpu_run.sh runs them."""

import json

import pytest
import torch
from conftest import MODERN_FLAGS, REPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main
from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.model import GPTConfig
from gpt_lightning.scaling.memory import parameter_count, training_memory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def sync_debug_mode_reset():
    """A failed sync check must not leave "error" set for the tests after it."""
    yield
    torch.cuda.set_sync_debug_mode("default")


def fit_on_cuda(small_text, tmp_path, *extra):
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "tiny-cpu.yaml"),
            "--trainer.accelerator",
            "cuda",
            "--data.data_path",
            str(small_text),
            "--trainer.limit_val_batches",
            "0",
            "--checkpoint.every_n_train_steps",
            "1000",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "tb"),
            *extra,
        ]
    )
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    return json.loads((run_dir / "throughput.json").read_text())


@pytest.mark.parametrize("compile", ["false", "true"])
def test_no_synchronizing_call_between_logging_intervals(compile, small_text, tmp_path):
    probe = {"class_path": "host_reads.SyncDebugProbe", "init_args": {"out": str(tmp_path / "watched.json")}}
    fit_on_cuda(
        small_text,
        tmp_path,
        "--model.compile",
        compile,
        "--trainer.max_steps",
        "21",
        "--trainer.log_every_n_steps",
        "5",
        f"--trainer.callbacks+={json.dumps(probe)}",
    )
    watched = json.loads((tmp_path / "watched.json").read_text())["watched"]
    assert len(watched) == 12  # steps 1-3, 6-8, 11-13, 16-18 ran with synchronizing calls forbidden


def test_throughput_on_a_gpu_uses_cuda_events_and_reports_memory_and_mfu(small_text, tmp_path):
    summary = fit_on_cuda(small_text, tmp_path, "--trainer.max_steps", "30")
    assert summary["accelerator"] == "cuda" and summary["compiled"] is True
    assert summary["peak_device_memory_bytes"] > 0 and summary["tokens_per_sec_median"] > 0
    if any(name in summary["device"] for name in ("A100", "H100", "H200")):
        assert 0 < summary["mfu"] < 1


def test_fsdp2_on_one_gpu_compiled_and_checkpointed(small_text, tmp_path):
    summary = fit_on_cuda(
        small_text,
        tmp_path,
        "--config",
        str(REPO / "configs" / "fsdp2.yaml"),
        "--trainer.devices",
        "1",
        "--model.activation_checkpointing",
        "true",
        "--trainer.max_steps",
        "20",
    )
    assert summary["compiled"] is True and summary["tokens_per_sec_median"] > 0
    assert (next((tmp_path / "tb").rglob("last.ckpt")) / "meta.pt").is_file()  # a sharded checkpoint


def test_fsdp2_validates_on_nccl(small_text, tmp_path):
    """On NCCL Lightning validates under torch.inference_mode unless the trainer says otherwise (gloo,
    the CPU tests' backend, always gets no_grad): configs/fsdp2.yaml as written validates, samples
    text, and goes on training."""
    summary = fit_on_cuda(
        small_text,
        tmp_path,
        "--config",
        str(REPO / "configs" / "fsdp2.yaml"),
        "--trainer.devices",
        "1",
        "--trainer.max_steps",
        "8",
        "--trainer.val_check_interval",
        "4",
        "--trainer.limit_val_batches",
        "2",
    )
    assert summary["compiled"] is True
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    val = events.Scalars("val/loss")
    assert [e.step for e in val] == [4, 8] and all(0 < e.value < 12 for e in val)


@pytest.mark.parametrize(
    "overlay",
    [[], ["--config", str(REPO / "configs" / "fsdp2.yaml"), "--trainer.devices", "1"]],
    ids=["one-gpu", "fsdp2"],
)
def test_peak_memory_of_gpt2_124m_is_near_the_guide_estimate(overlay, small_text, tmp_path):
    """The memory guide's figures (docs/multi-gpu.md), measured: GPT-2 124M, eager, bf16-mixed, B=4, T=1024, within 10%."""
    check_peak_memory(overlay, GPTConfig(), small_text, tmp_path)


def test_peak_memory_of_the_modern_124m_shape_is_near_the_estimate(small_text, tmp_path):
    """The same at 124M's shape with every modern switch (the softcap's float32 logits, value embeddings, ...)."""
    config = GPTConfig(
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
    )
    check_peak_memory(MODERN_FLAGS, config, small_text, tmp_path)


def check_peak_memory(overlay, config, small_text, tmp_path):
    summary = fit_on_cuda(
        small_text,
        tmp_path,
        *overlay,
        "--model.n_layer",
        "12",
        "--model.n_head",
        "12",
        "--model.n_embd",
        "768",
        "--data.block_size",
        "1024",
        "--data.batch_size",
        "4",
        "--data.val_fraction",
        "0",
        "--model.compile",
        "false",
        "--trainer.max_steps",
        "3",
        "--throughput.warmup_steps",
        "1",
        "--model.val_sample_tokens",
        "0",
    )
    estimate = training_memory(config, 4, 1024)
    # One process, so no DDP buckets: float32 states, autocast's bf16 weight copies, activations.
    expected = estimate.weights_grads_optimizer + 2 * parameter_count(config) + estimate.activations
    ratio = summary["peak_device_memory_bytes"] / expected
    print(
        f"peak {summary['peak_device_memory_bytes'] / 2**30:.2f} GiB, estimate {expected / 2**30:.2f} GiB, ratio {ratio:.2f}"
    )
    assert 0.9 < ratio < 1.1  # the guide's promise (docs/multi-gpu.md); the loss chunked, as training runs it


def test_generation_reads_nothing_back_and_the_compiled_step_gives_the_eager_tokens():
    from gpt_lightning.generation import generate
    from gpt_lightning.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=64)).cuda().eval()
    idx = torch.randint(0, 50257, (4, 8), device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
    try:
        sampled = generate(
            model, idx, 80, temperature=0.8, top_k=50, generator=generator, vocab_limit=50257
        )  # slides once
        greedy = generate(model, idx, 80, temperature=0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sampled.shape == (4, 88) and (sampled < 50257).all()
    assert torch.equal(generate(model, idx, 80, temperature=0, compile=True), greedy)  # CUDA graphs


def test_hellaswag_counts_stay_on_the_device_under_bf16():
    from test_hellaswag import synthetic_examples

    from gpt_lightning.data.tokenizer import gpt2_encoding
    from gpt_lightning.interop.hellaswag import batches, count_correct
    from gpt_lightning.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)).cuda().eval()
    ready = [b.to(torch.device("cuda")) for b in batches(synthetic_examples(6), gpt2_encoding().encode_ordinary, 64, 4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = count_correct(
            model, ready + [None], torch.device("cuda"), lambda: torch.autocast("cuda", dtype=torch.bfloat16)
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counts.tolist()[2] == 6


def test_the_training_forward_takes_cudnn_attention_on_hopper_and_decode_does_not():
    """The kernel SDPA dispatches to in a training step (under the module's context) and in decode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gpt_lightning.generation import generate
    from gpt_lightning.model import GPT
    from gpt_lightning.training.attention import attention_context, device_attention_backends

    class AttentionOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    device = torch.device("cuda")
    backends = device_attention_backends(device)
    if torch.cuda.get_device_capability(device) < (9, 0):
        assert backends is None
        pytest.skip("cuDNN attention is chosen on compute capability >= 9.0 only")
    assert backends is not None, "a Hopper GPU whose cuDNN has no attention (< 9)?"
    model = GPT(GPTConfig(block_size=1024, n_layer=1, n_head=12, n_embd=768)).to(device)
    idx = torch.randint(0, 50257, (2, 1024), device=device)
    with AttentionOps() as seen, torch.autocast("cuda", torch.bfloat16), attention_context(backends):
        model(idx, idx, head_loss=chunked_cross_entropy)[1].backward()
    assert any("cudnn" in op for op in seen.ops), seen.ops
    with AttentionOps() as seen, torch.autocast("cuda", torch.bfloat16):
        generate(model.eval(), idx[:, :8], 4, temperature=0)
    assert seen.ops and not any("cudnn" in op for op in seen.ops), seen.ops


def test_windowed_attention_compiled_on_cuda_is_flex_attention_and_equals_the_masked_sdpa(monkeypatch):
    """Sliding-window attention: eager (SDPA with the band) and compiled (flex attention with a block
    mask, blocks of 128 positions: the band skips some) give the same loss and gradients; the compiled
    decode step (CUDA graphs, the static cache masked) gives the eager cache's greedy tokens."""
    import gpt_lightning.model as model_module
    from gpt_lightning.generation import generate

    flex_calls = []
    flex_attention = model_module.flex_attention

    def counted(*args, **kwargs):
        flex_calls.append(1)  # at trace time
        return flex_attention(*args, **kwargs)

    monkeypatch.setattr(model_module, "flex_attention", counted)
    torch.manual_seed(0)
    config = GPTConfig(block_size=512, vocab_size=512, n_layer=2, n_head=2, n_embd=64, window_pattern="SL")
    model = model_module.GPT(config).cuda()
    assert model.transformer.h[0].attn.window == 128
    idx = torch.randint(0, 512, (2, 512), device="cuda")
    losses, grads = [], []
    for run in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad()
        loss = run(idx, idx.roll(-1, 1))[1]
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert flex_calls  # compiled: block 0 took flex attention
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for compiled, eager in zip(grads[1], grads[0]):
        torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-4)
    model.eval()
    prompt = idx[:, :200]  # longer than the window
    assert torch.equal(
        generate(model, prompt, 40, temperature=0, compile=True), generate(model, prompt, 40, temperature=0)
    )


def test_precision_auto_finds_the_gpu_s_bf16_and_leaves_cuda_uninitialized():
    """ddp_fork and ddp_notebook fork after the Trainer is built: ``precision: auto`` must not have made a
    CUDA context in the parent by then. A fresh process, as a notebook's kernel."""
    import subprocess
    import sys

    code = (
        "import torch; from gpt_lightning.training.precision import fast_precision; "
        "print(fast_precision('auto')[0], torch.cuda.is_initialized())"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert child.returncode == 0, child.stderr[-2000:]
    chosen, initialized = child.stdout.split()[-2:]
    assert initialized == "False"
    assert chosen == ("bf16-mixed" if torch.cuda.is_bf16_supported(including_emulation=False) else "32-true")
