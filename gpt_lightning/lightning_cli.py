"""``GPTLightningCLI``: Lightning's CLI with our module, data, callbacks and defaults, where what the
user typed wins, and every mistake is one line."""

from __future__ import annotations

import difflib
import json
import logging
import pydoc
import re
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor, ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.errors import UserError
from gpt_lightning.interop.checkpoint import LIGHTNING_CKPT_ALIASES, SHARDED_METADATA, read_checkpoint, saved_arguments
from gpt_lightning.lightning_internals import (
    CheckpointArguments,
    add_configure_optimizers,
    lightning_parse_ckpt_path,
    option_strings,
    rank_zero_logger,
)
from gpt_lightning.observing.console import StepProgressBar, TrainingFlopsSummary
from gpt_lightning.observing.samples import ValidationSamples
from gpt_lightning.observing.throughput import ThroughputMonitor
from gpt_lightning.scaling.swapped_checkpoints import put_back_swapped_aside
from gpt_lightning.stopping.dead_rank import PeerGoneReport, shorten_strategy_timeouts
from gpt_lightning.stopping.preemption import Preemption
from gpt_lightning.training.module import GPTLightningModule
from gpt_lightning.training.precision import AutoPrecisionTrainer

# Lightning messages a CLI user cannot act on, by how they start.
_UNACTIONABLE = (
    "💡 Tip:",  # advertising for Lightning's cloud products
    "Trainer already configured with model summary callbacks",  # we attach TrainingFlopsSummary on purpose
    "`Trainer.fit` stopped: `max_steps=",  # the bar already says N/N; printed mid-line after it
)


class _DropUnactionable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_UNACTIONABLE)


def quiet_lightning_console() -> None:
    """Drop the messages a CLI user cannot act on. Called by ``GPTLightningCLI`` only."""
    if not any(isinstance(f, _DropUnactionable) for f in rank_zero_logger().filters):
        rank_zero_logger().addFilter(_DropUnactionable())
    for message in (
        r".*isinstance\(treespec, LeafSpec\).*",
        r".*The dirpath has changed from.*",  # every resume logs into a new version directory
        r".*is smaller than the logging interval.*",  # logging counts optimizer steps across epochs
        r".*Your `IterableDataset` has `__len__` defined.*",
        r".*Total length of `list` across ranks is zero.*",
        r".*WeightAveraging callback with a model that overrides the configure_model.*",
    ):
        warnings.filterwarnings("ignore", message=message)


class GPTArgumentParser(LightningArgumentParser):
    """Lightning's parser, with errors on one line with a close match for a misspelt option, not ~100 of usage."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # a caller that asked for exceptions gets them
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        message = " ".join(message.split())
        sys.stderr.write(f"gpt-lightning: error: {message}{_did_you_mean(message, parser)}\n")
        sys.stderr.write(f"Every option: {parser.prog.replace(' [options]', '')} --help\n")
        self.exit(2)


def _did_you_mean(message: str, parser: LightningArgumentParser) -> str:
    """`` Did you mean --model.n_layer?`` for an unknown option close to a real one, else ''."""
    match = re.search(
        r"unrecognized arguments: (--[\w.]+)|does not accept (?:nested )?key '([\w.]+)'|"
        r"accept option '([\w.]+)'",
        message,
    )
    if not match:
        return ""
    wrong = "--" + next(group for group in match.groups() if group).lstrip("-")
    known = [option for option in option_strings(parser) if option.startswith("--")]
    close = difflib.get_close_matches(wrong, known, n=1, cutoff=0.8)
    return f"{'' if message.endswith('.') else '.'} Did you mean {close[0]}?" if close else ""


def check_config_files(args: list[str]) -> None:
    """Read every ``--config`` file first, so a YAML mistake is reported with the file's name."""
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        else:
            continue
        path = Path(value).expanduser()
        if not path.is_file():
            continue  # jsonargparse says "File does not exist" (or parses an inline YAML string)
        try:
            content = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"Config file {value} is not UTF-8 text.") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise UserError(f"Config file {value} is not valid YAML{where}: {problem}.") from None
        if content is not None and not isinstance(content, dict):
            raise UserError(
                f"Config file {value} must map sections to settings (trainer:, model:, data:, ...); "
                f"it holds a {type(content).__name__}."
            )


def _refuse_a_finished_run(ckpt_path: str, checkpoint: dict[str, Any], max_steps: int, newest: bool) -> None:
    """Refuse resuming a checkpoint already at ``max_steps``; found by ``--ckpt_path last``, exit 0 (done)."""
    step = checkpoint.get("global_step")
    if isinstance(step, int) and max_steps is not None and 0 <= max_steps <= step:
        if newest:
            rank_zero_info(
                f"--ckpt_path last: {ckpt_path} is at step {step}, trainer.max_steps is {max_steps}: "
                "this run is finished, nothing to do."
            )
            raise SystemExit(0)
        raise UserError(
            f"Checkpoint {ckpt_path} is at step {step}, and trainer.max_steps is {max_steps}: nothing is left to "
            f"train. To train on, raise it, e.g. --trainer.max_steps {2 * step if step else 1}."
        )


def _without_slurm_requeue(plugins: Any) -> list[Any]:
    """The user's plugins, plus ``SLURMEnvironment(auto_requeue=False)`` where they name no cluster
    environment: ``Preemption`` saves instead of Lightning's ``hpc_ckpt_N.ckpt`` (docs/resume.md)."""
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else ([] if plugins is None else [plugins])
    if not any(isinstance(p, ClusterEnvironment) for p in plugins):
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def _put_preemption_last(trainer: Trainer) -> None:
    """``Preemption`` (the user's or ours) after every other callback, before the checkpoint callbacks."""
    preemption = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None) or Preemption()
    others = [c for c in trainer.callbacks if c is not preemption]
    at = next((i for i, c in enumerate(others) if isinstance(c, Checkpoint)), len(others))
    trainer.callbacks = [*others[:at], preemption, *others[at:]]


def _is_model_parallel(strategy: Any) -> bool:
    """Whether a ``trainer.strategy`` setting (name, class path or instance) is ``ModelParallelStrategy``."""
    if isinstance(strategy, ModelParallelStrategy):
        return True
    class_path = str(strategy if isinstance(strategy, str) else getattr(strategy, "class_path", ""))
    if class_path.endswith("ModelParallelStrategy"):
        return True
    located = pydoc.locate(class_path) if "." in class_path else None
    return isinstance(located, type) and issubclass(located, ModelParallelStrategy)


class GPTLightningCLI(CheckpointArguments, LightningCLI):
    """LightningCLI with the GPT module and data, TensorBoard logs under ``logs/``, and checkpoint, learning-rate
    and throughput callbacks (``--checkpoint.*``, ...). With ``--ckpt_path`` the checkpoint's settings fill in
    only what the user did not give (docs/resume.md)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("parser_class", GPTArgumentParser)
        kwargs.setdefault("trainer_class", AutoPrecisionTrainer)  # --trainer.precision auto: the fast one here
        kwargs["parser_kwargs"] = {"prog": "gpt-lightning", **(kwargs.get("parser_kwargs") or {})}
        # A config.yaml left by a run without a logger must not stop the next run.
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self._cli_args: list[str] | None = None
        quiet_lightning_console()
        shorten_strategy_timeouts()  # --trainer.strategy ddp (or auto): 10 minutes, not 30
        super().__init__(GPTLightningModule, TokenStreamDataModule, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's, less ``predict`` (text comes out of ``gpt-lightning sample``)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(ThroughputMonitor, "throughput")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "logs", "name": "gpt", "default_hp_metric": False},
                },
                "checkpoint.save_last": True,
                # last.ckpt is the run's one checkpoint: a top-1 by step would be a second copy of it.
                "checkpoint.save_top_k": 0,
                "checkpoint.every_n_train_steps": 100,
            }
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None or isinstance(args, list):
            self._cli_args = list(sys.argv[1:] if args is None else args)
            check_config_files(self._cli_args)
        super().parse_arguments(parser, args)

    def parse_ckpt_path(self) -> None:
        """Put the checkpoint's settings *before* the user's arguments and parse again, so the user's
        win (Lightning's ``_parse_ckpt_path``, which this replaces, merges them over)."""
        subcommand = self.config.get("subcommand")
        if not subcommand or self._cli_args is None or subcommand not in self._cli_args:
            return lightning_parse_ckpt_path(self)
        ckpt_path = self.config[subcommand].get("ckpt_path")
        resolved = []
        if ckpt_path == "last" and subcommand == "fit" and (runs := self._runs_folder()) is not None:
            newest = self._newest_last_checkpoint(runs)
            if newest is None:  # the first launch of a job that relaunches with the same command
                self.config.fit.ckpt_path = None
                return
            ckpt_path = str(newest)
            resolved = ["--ckpt_path", ckpt_path]
        if not ckpt_path or ckpt_path in LIGHTNING_CKPT_ALIASES:
            return
        checkpoint = read_checkpoint(ckpt_path, weights=False)  # the settings are all it needs
        model = saved_arguments(checkpoint, self.model_class)  # block_size too: it may exceed the data's
        data = saved_arguments(checkpoint, self.datamodule_class, "datamodule_hyper_parameters")
        from_checkpoint = ["--model", json.dumps(model), "--data", json.dumps(data)]
        at = self._cli_args.index(subcommand) + 1
        # The weights come from the checkpoint: model.init_from (a fresh start's source) is not read.
        fresh_start_only = ["--model.init_from", "null"]
        self.config = self.parser.parse_args(
            self._cli_args[:at] + from_checkpoint + self._cli_args[at:] + fresh_start_only + resolved
        )
        if subcommand == "fit":
            _refuse_a_finished_run(ckpt_path, checkpoint, self.config.fit.trainer.max_steps, newest=bool(resolved))

    def _runs_folder(self) -> Path | None:
        """This logger's folder of numbered runs, where ``--ckpt_path last`` looks; None: not numbered (Lightning's)."""
        fit = self.config.fit
        logger = fit.trainer.get("logger")
        init_args = getattr(logger, "init_args", None) or {}
        save_dir, name = init_args.get("save_dir"), init_args.get("name") or ""
        fixed_run = any(init_args.get(key) is not None for key in ("version", "id", "run_id"))
        if fixed_run or fit.get("checkpoint", {}).get("dirpath"):
            return None
        located = pydoc.locate(str(getattr(logger, "class_path", "")))
        if isinstance(located, type) and not issubclass(located, (TensorBoardLogger, CSVLogger)):
            raise UserError(
                f"--ckpt_path last resumes the newest numbered run (version_N/), and {located.__name__} starts a new "
                "run folder at each launch. Give every launch the same --checkpoint.dirpath (e.g. --checkpoint.dirpath "
                "checkpoints); --ckpt_path last then finds last.ckpt there."
            )
        if save_dir is None:
            return None
        return Path(save_dir).expanduser() / name

    @staticmethod
    def _newest_last_checkpoint(runs: Path) -> Path | None:
        """The ``last.ckpt`` of the newest run under ``runs`` that has one; None (said once) if none has."""
        for aside in runs.glob("version_*/checkpoints/.last.ckpt.old"):  # a swap the run was killed in
            put_back_swapped_aside(aside.parent / "last.ckpt")
        found = [p for p in runs.glob("version_*/checkpoints/last.ckpt") if p.parent.parent.name[8:].isdigit()]
        if not found:
            rank_zero_info(f"--ckpt_path last: no run under {runs} has a checkpoints/last.ckpt yet; starting fresh.")
            return None
        newest = max(found, key=lambda p: int(p.parent.parent.name[8:]))
        rank_zero_info(f"--ckpt_path last: resuming from {newest}")
        return newest

    def before_instantiate_classes(self) -> None:
        """``model.block_size`` follows ``data.block_size`` unless it, or ``model.init_from``, is given."""
        model = self._get(self.config, "model")
        if model.block_size is None and model.init_from is None:
            model.block_size = self._get(self.config, "data").block_size

    def instantiate_classes(self) -> None:
        """Lightning's, with the model built on the meta device under ``ModelParallelStrategy`` (sharded later)."""
        if not _is_model_parallel(self._get(self.config, "trainer", {}).get("strategy")):
            return super().instantiate_classes()
        with torch.device("meta"):
            self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        add_configure_optimizers(self, self.subcommand)
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with our samples, progress bar and FLOPs summary unless off or the user's, and ``Preemption``."""
        trainer_config = self._get(self.config_init, "trainer", {})
        callbacks = list(kwargs.pop("callbacks", None) or trainer_config.get("callbacks") or [])
        callbacks.append(PeerGoneReport())  # a rank gone after the first step: one line from the CLI
        if not any(isinstance(c, ValidationSamples) for c in callbacks):
            callbacks.append(ValidationSamples())  # --model.val_sample_tokens sets it (0: off)
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(StepProgressBar())
        if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks
        ):
            callbacks.append(TrainingFlopsSummary())
        if SLURMEnvironment.detect() and not TorchElasticEnvironment.detect():  # torchrun in an allocation: its ranks
            kwargs["plugins"] = _without_slurm_requeue(trainer_config.get("plugins"))
        try:
            trainer = super().instantiate_trainer(callbacks=callbacks, **kwargs)
        except (ValueError, TypeError, ModuleNotFoundError, RuntimeError) as err:
            # Trainer() only validates the trainer settings it was given: the user's.
            raise UserError(f"The trainer settings are not usable here: {err}") from None
        _put_preemption_last(trainer)
        if not trainer.loggers:  # --trainer.logger false: our learning-rate monitor has nowhere to write
            ours = self._get(self.config_init, "lr_monitor")
            trainer.callbacks = [c for c in trainer.callbacks if c is not ours]
        return trainer

    def before_fit(self) -> None:
        trainer = self.trainer
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        sharded = bool(ckpt_path) and (Path(ckpt_path).expanduser() / SHARDED_METADATA).is_file()
        if sharded and not isinstance(trainer.strategy, ModelParallelStrategy):
            raise UserError(
                f"Checkpoint {ckpt_path} is a folder of shards, written under FSDP2, and only "
                "ModelParallelStrategy resumes it. Add --config configs/fsdp2.yaml (or --trainer.strategy.class_path "
                "ModelParallelStrategy). Its weights alone load anywhere: gpt-lightning export --ckpt_path "
                f"{ckpt_path} --out weights.safetensors."
            )
        stale = sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
        plugins = self._get(self.config_init, "trainer", {}).get("plugins")
        plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins]
        asked = any(isinstance(p, SLURMEnvironment) and p.auto_requeue for p in plugins)  # Lightning's way, chosen
        if not ckpt_path and stale and SLURMEnvironment.detect() and not asked:
            raise UserError(
                f"{stale[-1]} (Lightning's SLURM auto-requeue checkpoint) is in {trainer.default_root_dir}, and Lightning "
                f"would resume this run from it unasked. Resume from it with --ckpt_path {stale[-1]}, or move it away; "
                "gpt-lightning saves last.ckpt on SIGTERM instead (docs/resume.md, On a cluster)."
            )
        for option, value in (("max_steps", trainer.max_steps), ("max_epochs", trainer.max_epochs)):
            if value == 0:
                raise UserError(
                    f"trainer.{option} is 0: nothing would be trained. Give a positive number "
                    "(or -1 for no limit), e.g. --trainer.max_steps 200."
                )
