"""The fast precision: ``precision: auto`` (the CPU configs') is bf16-mixed where the CPU or GPU runs
bfloat16 natively and 32-true where it emulates it, as measured; a run that asks for bf16 where it is
emulated is told so in one line. Most laptop and desktop CPUs emulate it, 20-50x slower than float32."""

import ctypes
import functools
import time
import typing
import weakref
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import nvml_device_index
from gpt_lightning.precision import matmul_dtype

# A bf16 matmul this many times slower than float32's means emulation: native bf16 takes 0.5-1x
# float32's time (AVX512-BF16, AMX), emulated 20-50x (AVX2: AMD before Zen 4, Intel client cores).
EMULATED = 2.0
# Lightning's own precision values (its Trainer's annotation, read through typing), and "auto".
PRECISION = Literal["auto"] | typing.get_type_hints(Trainer.__init__)["precision"]
_told: "weakref.WeakSet[Trainer]" = weakref.WeakSet()  # trainers already told their bf16 is emulated


@functools.cache
def cpu_bf16_slowdown() -> float:
    """How many times longer a bfloat16 matmul takes than a float32 one on this CPU: measured once per
    process (128^3, one thread, best of 4: a few ms), so it honours ``ONEDNN_MAX_CPU_ISA`` and the like."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy core's stalls in a thread pool would swamp 50 us
    try:
        generator = torch.Generator().manual_seed(0)  # not the global one: a seeded run's draws stay its own
        a, b = torch.randn(128, 128, generator=generator), torch.randn(128, 128, generator=generator)
        pairs = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
        best = dict.fromkeys(pairs, float("inf"))
        for _ in range(5):  # the first round warms up (oneDNN builds its kernels), and counts as one
            for dtype, (x, y) in pairs.items():
                start = time.perf_counter()
                x @ y
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / best[torch.float32]


@functools.cache
def cuda_has_bf16() -> bool:
    """Whether the CUDA GPU runs bfloat16 natively (capability >= 8.0), asked of NVML while CUDA is not initialized
    (``ddp_fork`` and ``ddp_notebook`` need it not to be); else, or where NVML cannot answer (a warning), of CUDA."""
    if not torch.cuda.is_initialized():
        try:
            return nvml_compute_capability(nvml_device_index(0)) >= (8, 0)
        except (OSError, RuntimeError, AttributeError, IndexError) as err:  # IndexError: no GPU visible
            rank_zero_warn(
                f"precision auto: NVML could not tell whether this GPU has bf16 ({err}); asking CUDA in this "
                "process, which initializes it here (ddp_fork and ddp_notebook need it not to be)."
            )
    return torch.cuda.is_bf16_supported(including_emulation=False)


def nvml_compute_capability(index: int) -> tuple[int, int]:
    """The compute capability of the GPU NVML numbers ``index``: ``(major, minor)``; OSError where NVML is missing,
    RuntimeError with NVML's status where it fails."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
    for call, *args in (
        (nvml.nvmlInit_v2,),
        (nvml.nvmlDeviceGetHandleByIndex_v2, ctypes.c_uint(index), ctypes.byref(handle)),
        (nvml.nvmlDeviceGetCudaComputeCapability, handle, ctypes.byref(major), ctypes.byref(minor)),
        (nvml.nvmlShutdown,),
    ):
        if status := call(*args):
            raise RuntimeError(f"NVML status {status}")
    return major.value, minor.value


def _device_type(accelerator: str | Accelerator) -> str:
    """``cpu``, ``cuda`` or another device type, for a Trainer's ``accelerator`` argument, as Lightning picks it."""
    if isinstance(accelerator, CPUAccelerator):
        return "cpu"
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    if isinstance(accelerator, Accelerator):
        return "other"
    if accelerator in ("auto", "gpu"):
        if CUDAAccelerator.is_available():  # Lightning's test: NVML's count, no CUDA initialized (as is_available)
            return "cuda"
        return "cpu" if accelerator == "auto" and not torch.backends.mps.is_available() else "other"
    return accelerator


def fast_precision(accelerator: str | Accelerator = "auto") -> tuple[str, str]:
    """``(precision, why)``: bf16-mixed on a CUDA GPU with bf16 or a CPU whose bf16 matmul is native (measured:
    ``cpu_bf16_slowdown``), else 32-true (float16 is left to be asked for: it needs loss scaling)."""
    device = _device_type(accelerator)
    if device == "cuda":
        if cuda_has_bf16():
            return "bf16-mixed", "this CUDA GPU has bf16"
        return "32-true", "this CUDA GPU has no bf16"
    if device != "cpu":
        return "32-true", f"bf16 is chosen only on CPUs and CUDA GPUs that run it natively, not on {device}"
    slowdown = cpu_bf16_slowdown()
    if slowdown > EMULATED:
        return "32-true", f"this CPU emulates bf16: a bf16 matmul runs {slowdown:.0f}x slower than float32, measured"
    return "bf16-mixed", f"this CPU runs bf16 natively: a bf16 matmul takes {slowdown:.1f}x float32's time, measured"


def fast_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: bfloat16 where ``device`` runs it natively (as ``fast_precision`` decides), else
    float32; what ``auto`` means to ``eval`` and ``sample``."""
    if device.type == "cuda":
        torch.cuda.init()  # they run on it next: its bf16 is asked of CUDA here
    precision, why = fast_precision(device.type)
    return matmul_dtype(precision), why


class AutoPrecisionTrainer(Trainer):
    """Customize every aspect of training via flags; precision also takes auto.

    Lightning's ``Trainer``, whose ``precision`` also takes ``"auto"``: the fast one where it runs
    (``fast_precision``), said in one line. The CLI's trainer; the CPU configs ask for it."""

    def __init__(self, *, precision: PRECISION = None, **kwargs: Any) -> None:
        """
        Args:
            precision: Lightning's (32-true, bf16-mixed, 16-mixed, ...), or "auto": bf16-mixed where the CPU
                or GPU runs bf16 natively, else 32-true (a measured bf16 matmul decides on a CPU).
        """
        if precision == "auto":
            precision, why = fast_precision(kwargs.get("accelerator", "auto"))
            rank_zero_info(f"precision auto: {precision} ({why}).")
        super().__init__(precision=precision, **kwargs)


def check_float16_epsilon(optimizers: typing.Iterable[torch.optim.Optimizer]) -> None:
    """Refuse to train float16 parameters (``16-true``) with an Adam-family ``eps`` float16 cannot hold: the
    moments are float16 too, so an ``eps`` below float16's smallest normal (6.1e-05; 1e-8 rounds to 0) divides
    small gradients' updates by (nearly) zero and the run diverges within a few steps."""
    tiny = torch.finfo(torch.float16).tiny
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            eps = group.get("eps", tiny)
            if "betas" in group and eps < tiny and any(p.dtype == torch.float16 for p in group["params"]):
                raise UserError(
                    f"16-true keeps AdamW's moments in float16, where eps {eps:g} is (nearly) zero: the first updates "
                    f"divide by it and the run diverges. Give --model.eps 1e-4 (--optimizer.eps with your own "
                    f"--optimizer; at least float16's {tiny:.2g}), or train in 16-mixed (float32 weights and "
                    "optimizer, float16 matmuls) or bf16-true where the device has bf16."
                )


def warn_if_bf16_is_emulated(trainer: Trainer) -> None:
    """One line, once per trainer on rank 0, when it runs bf16 on a CPU that emulates it: how much slower, and the fix."""
    precision = str(trainer.precision)
    if matmul_dtype(precision) != torch.bfloat16 or trainer.strategy.root_device.type != "cpu" or trainer in _told:
        return
    _told.add(trainer)
    slowdown = cpu_bf16_slowdown()
    if slowdown > EMULATED:
        rank_zero_warn(
            f"{precision} on this CPU is slow: it emulates bf16, and a bf16 matmul runs {slowdown:.0f}x slower than "
            "float32 (measured). Train in float32: --trainer.precision 32-true (in Python, Trainer(precision='32-true')), "
            "or --trainer.precision auto, the fast one wherever it runs."
        )
