"""A callback the sync-free test attaches through the CLI: it counts host reads of tensor values
(``aten._local_scalar_dense``, which ``.item()``, ``float(t)``, ``bool(t)`` and ``int(t)`` dispatch
to) for each training step, and writes them to a JSON file."""

import json
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode


class _Counter(TorchDispatchMode):
    def __init__(self, probe: "HostReadCounter") -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and self.probe.step is not None:
            where = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][
                -8:
            ]
            self.probe.reads[self.probe.step].append(where)
        return func(*args, **(kwargs or {}))


class HostReadCounter(Callback):
    """Host reads per training step, from one step's batch start to the next one's."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.step: int | None = None  # index of the training step now running, None outside training
        self.reads: dict[int, list] = defaultdict(list)

    def on_train_start(self, trainer, pl_module):
        self.mode = _Counter(self)
        self.mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_validation_start(self, trainer, pl_module):
        self.step = None  # validation reads its metrics: not a training step

    def on_train_end(self, trainer, pl_module):
        self.step = None
        self.mode.__exit__(None, None, None)
        steps = trainer.global_step
        self.out.write_text(json.dumps({"steps": steps, "reads": {str(k): v for k, v in self.reads.items()}}))


class SyncDebugProbe(Callback):
    """On CUDA: any synchronizing call (a device-to-host copy, ``.item()``, a stream sync) during a
    step between logging intervals raises, through ``torch.cuda.set_sync_debug_mode("error")``.

    Step k is watched from its batch start to the next step's batch start when neither it nor the
    step before it ends a logging interval (those read values on purpose), and k > 0. An epoch's
    end stops the watch: Lightning's LearningRateMonitor copies the rates to the device once at
    each epoch's start.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.watched: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        k, every = trainer.global_step, trainer.log_every_n_steps
        watch = k > 0 and k % every not in (0, every - 1)
        torch.cuda.set_sync_debug_mode("error" if watch else "default")
        if watch:
            self.watched.append(k)

    def on_validation_start(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode("default")

    def on_train_epoch_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, pl_module, exception):
        torch.cuda.set_sync_debug_mode("default")  # the next test must not inherit "error"

    def on_train_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode("default")
        self.out.write_text(json.dumps({"watched": self.watched}))


class BarrierCounter(Callback):
    """``torch.distributed.barrier`` calls per training step (Lightning's ``sync_dist`` makes one
    before each all-reduce; on NCCL a barrier blocks the host until the device catches up)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.step: int | None = None
        self.barriers: dict[int, int] = defaultdict(int)

    def on_train_start(self, trainer, pl_module):
        self.original = torch.distributed.barrier

        def counted(*args, **kwargs):
            if self.step is not None:
                self.barriers[self.step] += 1
            return self.original(*args, **kwargs)

        torch.distributed.barrier = counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_validation_start(self, trainer, pl_module):
        self.step = None

    def on_train_end(self, trainer, pl_module):
        self.step = None
        torch.distributed.barrier = self.original
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"steps": trainer.global_step, "barriers": self.barriers}))


class CollectiveCounter(Callback):
    """Per optimizer step, on every rank: the Python-level collectives (``broadcast``, ``all_reduce``,
    ``barrier``; DDP's gradient all-reduce runs inside its C++ reducer and is not among them) and the
    host reads of tensor values. Written to ``out_dir/rank{r}.json`` when the fit ends or stops."""

    NAMES = ("broadcast", "all_reduce", "barrier")

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.step: int | None = None
        self.counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.reads: dict[int, list] = defaultdict(list)

    def on_train_start(self, trainer, pl_module):
        self.originals = {name: getattr(torch.distributed, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(torch.distributed, name, self._counted(name, original))
        self.mode = _Counter(self)
        self.mode.__enter__()

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            if self.step is not None:
                self.counts[self.step][name] += 1
            return original(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_validation_start(self, trainer, pl_module):
        self.step = None

    def _write(self, trainer):
        self.step = None
        self.mode.__exit__(None, None, None)
        for name, original in self.originals.items():
            setattr(torch.distributed, name, original)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "steps": trainer.global_step,
            "counts": {str(k): dict(v) for k, v in self.counts.items()},
            "reads": {str(k): len(v) for k, v in self.reads.items()},
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_end(self, trainer, pl_module):
        self._write(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self._write(trainer)
