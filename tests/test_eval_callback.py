"""``HarnessEval``: lm-evaluation-harness tasks during training, on a local task YAML (no network).
In a real Trainer it logs ``eval/<task>/<metric>`` and trains the very weights of the run without it
(dropout and shuffling included: training's random state is restored); a run resumed through the
CLI with it on ends with the weights of the uninterrupted run. The shipped ``gpt2-suite`` group
resolves to tasks the harness knows. (Two DDP processes: tests/test_ddp.py.)"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_MODEL
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_resume_exact import corpus, fit, weights  # noqa: F401 (corpus: a fixture)

from gpt_lightning import GPTLightningModule, TokenStreamDataModule

TASK = "shakespeare_mc"
TAGS = [f"eval/{TASK}/acc", f"eval/{TASK}/acc_norm"]


def write_task(folder: Path, text: str, examples: int = 7) -> Path:
    """A multiple-choice task on a local JSON-lines file: a line of Shakespeare, the next line
    among three choices."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) > 20]
    docs = [
        {"context": lines[i], "choices": [lines[i + 1], lines[i + 40], lines[i + 80]], "label": 0}
        for i in range(0, 6 * examples, 6)
    ]
    (folder / "mc.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files: {folder / 'mc.jsonl'}\ntest_split: train\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
    )
    return folder


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def test_logs_the_tasks_and_trains_the_weights_of_a_run_without_it(tmp_path, shakespeare):
    from gpt_lightning import HarnessEval

    (tmp_path / "text.txt").write_text(shakespeare[:20_000])
    tasks = write_task(tmp_path / "tasks", shakespeare)

    def train(callbacks: list, name: str) -> GPTLightningModule:
        torch.manual_seed(0)
        module = GPTLightningModule(**TINY_MODEL, block_size=32, dropout=0.1, val_sample_tokens=0)
        module.model.transformer.h[
            0
        ].attn.c_proj.register_forward_hook(  # the pass runs in eval mode, training does not
            lambda layer, inputs, output: None if layer.training else pass_dtypes.add(output.dtype)
        )
        data = TokenStreamDataModule(
            str(tmp_path / "text.txt"), batch_size=2, block_size=32, shuffle=True, cache_dir=str(tmp_path / "cache")
        )
        Trainer(
            accelerator="cpu",
            precision="bf16-mixed",
            max_steps=4,
            limit_val_batches=0,
            callbacks=callbacks,
            logger=TensorBoardLogger(tmp_path, name=name),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, data)
        return module

    harness = HarnessEval(tasks=TASK, every_n_steps=4, limit=7, include_path=str(tasks))
    pass_dtypes = set()
    evaluated = train([harness], "with")
    assert pass_dtypes == {torch.bfloat16}  # the pass runs in the training precision (bf16-mixed's autocast)
    plain = train([], "without")
    assert [result["step"] for result in harness.results] == [0, 4]  # the first step and the end
    (run_dir,) = (tmp_path / "with").iterdir()
    for tag in TAGS:
        logged = scalars(run_dir, tag)
        assert sorted(logged) == [0, 4] and all(0 <= value <= 1 for value in logged.values())
        assert logged[4] == pytest.approx(harness.results[-1][tag])
    assert evaluated.training  # back in training mode after each pass
    # Same dropout masks and batch order: the harness's seeding (it seeds torch, numpy and random) was undone.
    expected, got = plain.state_dict(), evaluated.state_dict()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


def test_resumed_with_it_on_ends_with_the_weights_of_the_uninterrupted_run(tmp_path, corpus, shakespeare):  # noqa: F811
    """Through the CLI (configs/tiny-cpu.yaml at its auto precision, shuffled): the run resumed at step 2 with
    ``HarnessEval`` on (it scores as it resumes and at the end) ends where the run without it does."""
    harness = {
        "class_path": "gpt_lightning.HarnessEval",
        "init_args": {
            "tasks": TASK,
            "every_n_steps": 2,
            "limit": 5,
            "include_path": str(write_task(tmp_path / "tasks", shakespeare)),
        },
    }
    every = ["--checkpoint.every_n_train_steps", "2", "--trainer.max_steps", "4", "--data.shuffle", "true"]
    whole = fit(tmp_path, "whole", corpus, *every)
    (at_stop,) = whole.glob("*step=2.ckpt")
    resumed = fit(
        tmp_path, "resumed", corpus, *every, "--ckpt_path", str(at_stop), f"--trainer.callbacks+={json.dumps(harness)}"
    )
    expected, got = weights(whole / "last.ckpt"), weights(resumed / "last.ckpt")
    assert all(torch.equal(expected[key], got[key]) for key in expected)
    assert sorted(scalars(resumed.parent, TAGS[0])) == [2, 4]


def test_the_reference_suite_resolves_to_tasks_the_harness_knows():
    import lm_eval.tasks
    from lm_eval.api.group import GroupConfig
    from lm_eval.tasks import TaskManager

    from gpt_lightning.evaluation.suite import SUITE_DIR

    config = yaml.safe_load((SUITE_DIR / "gpt2-suite.yaml").read_text())
    group = GroupConfig(**config)
    # The harness's own folders of these tasks, not all of its thousands (10 s to index on 2 cores).
    harness = Path(lm_eval.tasks.__file__).parent
    folders = [harness / name for name in ("hellaswag", "arc", "piqa", "winogrande", "lambada", "openbookqa")]
    manager = TaskManager(include_path=[SUITE_DIR, *folders], include_defaults=False)
    assert "gpt2-suite" in manager.all_groups
    assert set(group.task) == {
        "hellaswag",
        "arc_easy",
        "arc_challenge",
        "piqa",
        "winogrande",
        "lambada_openai",
        "openbookqa",
    }
    assert set(group.task) <= set(manager.all_subtasks)  # each a task of the harness's own, not a group or a typo
    assert [metric.metric for metric in group.aggregate_metric_list] == ["acc"]


def test_our_suite_is_looked_up_with_the_harness_tasks_it_names(monkeypatch):
    """gpt2-suite is a group of the harness's tasks: ``task_manager`` must not settle for the quick
    index of our own folders (where it found the group but none of its tasks, and loading it died
    in a TypeError). Offline, loading it then ends in the one-line offline error's cause."""
    import datasets
    import lm_eval.tasks

    from gpt_lightning.evaluation import tasks

    harness = Path(lm_eval.tasks.__file__).parent
    folders = [str(harness / name) for name in ("hellaswag", "arc", "piqa", "winogrande", "lambada", "openbookqa")]

    class HarnessIndex(lm_eval.tasks.TaskManager):  # the whole index, cut to these tasks' folders (10 s less)
        def __init__(self, include_path, include_defaults=True):
            made.append(include_defaults)
            super().__init__(include_path=include_path + (folders if include_defaults else []), include_defaults=False)

    made = []
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", HarnessIndex)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    manager = tasks.task_manager(["gpt2-suite"])
    assert made == [False, True] and "hellaswag" in manager.all_subtasks
    with pytest.raises(Exception) as raised:
        manager.load_task_or_group(["gpt2-suite"])
    assert tasks.is_offline_error(raised.value), repr(raised.value)


def test_a_task_with_fewer_examples_than_ranks_is_refused_before_training(tmp_path, shakespeare):
    """With no limit too: the task's own examples count (7 here, 8 ranks)."""
    from types import SimpleNamespace

    from gpt_lightning import HarnessEval
    from gpt_lightning.errors import UserError

    harness = HarnessEval(tasks=TASK, include_path=str(write_task(tmp_path / "tasks", shakespeare, examples=7)))
    with pytest.raises(UserError, match=f"task {TASK} has 7 example"):
        harness.setup(SimpleNamespace(world_size=8), SimpleNamespace(device_mesh=None), "fit")
    harness.setup(SimpleNamespace(world_size=7), SimpleNamespace(device_mesh=None), "fit")  # one each


def test_a_limit_below_the_number_of_ranks_is_refused_before_training():
    """A rank given no example fails inside the harness while the others wait in its gather."""
    from types import SimpleNamespace

    from gpt_lightning import HarnessEval
    from gpt_lightning.errors import UserError

    with pytest.raises(UserError, match="limit 1 is below the 2 ranks"):
        HarnessEval(tasks="my_task", limit=1).setup(
            SimpleNamespace(world_size=2), SimpleNamespace(device_mesh=None), "fit"
        )
