"""lm-evaluation-harness on our GPT: the same results as the harness's own ``hf`` model on the
``export --format hf`` folder of the same checkpoint, for each kind of request, on local task YAMLs
(no network), through the Python API and through ``gpt-lightning eval --tasks``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ONE_QUIET_CPU_STEP, REPO, TINY_MODEL
from lightning.pytorch import Trainer

from gpt_lightning.commands.export import main as export_main
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.training.module import GPTLightningModule

pytest.importorskip("lm_eval")

BLOCK_SIZE = 64
TASKS = {  # name -> (output type, the YAML's own lines)
    "shakespeare_mc": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "shakespeare_next": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{' ' + choices[0]}}"
metric_list:
  - metric: perplexity
  - metric: acc
""",
    "shakespeare_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{passage}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "shakespeare_gen": """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{choices[0]}}"
generation_kwargs:
  until: [":", "?"]
  do_sample: false
  max_gen_toks: 12
metric_list:
  - metric: exact_match
""",
}


def write_tasks(folder, text: str) -> None:
    """The four task YAMLs over one JSON-lines file of Shakespeare: a line as context, the next
    line and three others as choices; a passage several times the model's context long."""
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) > 20]
    docs = []
    for i in range(0, 72, 6):
        choices = [lines[i + 1], lines[i + 40], lines[i + 80], lines[i + 3]]
        docs.append({"context": lines[i], "choices": choices, "label": 0, "passage": " ".join(lines[i : i + 12])})
    data = folder / "shakespeare.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    for name, body in TASKS.items():
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {data}\ntest_split: train\n{body}"
        )


def train(root, text_file, **switches):
    """A checkpoint of a tiny model trained a few steps on ``text_file``, as ``gpt-lightning fit`` writes it."""
    module = GPTLightningModule(**TINY_MODEL, block_size=BLOCK_SIZE, **switches)
    data = TokenStreamDataModule(
        str(text_file), batch_size=4, block_size=BLOCK_SIZE, val_fraction=0.0, cache_dir=str(root)
    )
    trainer = Trainer(**{**ONE_QUIET_CPU_STEP, "max_steps": 2})
    trainer.fit(module, data)
    path = root / ("modern.ckpt" if switches else "gpt2.ckpt")
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shakespeare):
    """Tasks, a GPT-2 and a modern checkpoint, the GPT-2's ``export --format hf`` folder."""
    root = tmp_path_factory.mktemp("evaluation")
    (root / "tasks").mkdir()
    write_tasks(root / "tasks", shakespeare)
    (root / "text.txt").write_text(shakespeare[:40_000])
    gpt2 = train(root, root / "text.txt")
    modern = train(
        root,
        root / "text.txt",
        bias=False,
        rotary=True,
        norm="rmsnorm",
        norm_affine=False,
        qk_norm=True,
        activation="relu2",
        tie_embeddings=False,
        logit_softcap=15.0,
        value_embeddings=True,
    )
    export_main(["--ckpt_path", str(gpt2), "--format", "hf", "--out", str(root / "hf")])
    return root, gpt2, modern


def evaluate(lm, root, tasks=tuple(TASKS)):
    from gpt_lightning.evaluation.tasks import run_tasks

    return run_tasks(lm, list(tasks), include_path=root / "tasks", limit=8, log_samples=True, bootstrap_iters=0)


def responses(results, task):
    return [sample["resps"] for sample in results["samples"][task]]


def test_our_model_gives_the_harness_hf_models_results(setup):
    from lm_eval.models.huggingface import HFLM

    from gpt_lightning.evaluation.harness_model import GPTHarnessLM

    root, gpt2, _ = setup
    ours = evaluate(GPTHarnessLM.from_checkpoint(gpt2, batch_size=4), root)
    theirs = evaluate(HFLM(pretrained=str(root / "hf"), batch_size=4, device="cpu"), root)
    for task in TASKS:
        mine, hf = ours["results"][task], theirs["results"][task]
        metrics = [key for key in hf if "," in key and "stderr" not in key]
        assert metrics and set(metrics) <= set(mine), task
        for key in metrics:
            if key.startswith(("acc", "exact_match")):
                assert mine[key] == hf[key], (task, key)
            else:  # perplexities, bits per byte
                assert mine[key] == pytest.approx(hf[key], rel=1e-4), (task, key)
        if task == "shakespeare_gen":  # identical greedy text
            assert responses(ours, task) == responses(theirs, task)
            assert any(r[0][0].strip() for r in responses(ours, task))
            continue
        for a, b in zip(responses(ours, task), responses(theirs, task), strict=True):
            for x, y in zip(a, b, strict=True):
                x, y = (x[0], y[0]) if isinstance(x, (tuple, list)) else (x, y)  # (loglikelihood, greedy) or a sum
                assert x == pytest.approx(y, abs=2e-4, rel=2e-4), task
    assert len(ours["samples"]["shakespeare_rolling"]) == 8  # documents of ~150 tokens: 3 windows of 64 each


LAUNCH = """
import sys
import gpt_lightning, gpt_lightning.cli, gpt_lightning.commands.eval, gpt_lightning.evaluation
assert "lm_eval" not in sys.modules, "importing gpt_lightning imported lm_eval"
gpt_lightning.cli.main(sys.argv[1:])
"""


def test_eval_tasks_from_the_command_line_scores_a_modern_checkpoint(setup):
    """``gpt-lightning eval --tasks`` on local YAMLs: the harness's table, its results JSON and samples; the
    modern model's (rotary, value embeddings, ...) log-likelihoods are its own forward pass's."""
    from gpt_lightning.data.tokenizer import gpt2_encoding
    from gpt_lightning.interop.checkpoint import gpt_from_checkpoint

    root, _, modern = setup
    out = root / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "eval",
            "--tasks",
            "shakespeare_mc,shakespeare_rolling,shakespeare_gen",
            "--include_path",
            str(root / "tasks"),
            "--ckpt_path",
            str(modern),
            "--limit",
            "4",
            "--batch_size",
            "3",
            "--device",
            "cpu",
            "--dtype",
            "float32",  # its log-likelihoods are compared with float32's own forward pass
            "--output_path",
            str(out),
            "--log_samples",
            "--bootstrap_iters",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not a git repository" not in result.stderr  # the harness's git probe, outside a repository
    assert "|shakespeare_mc" in result.stdout and "bits_per_byte" in result.stdout  # the harness's table
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"shakespeare_mc", "shakespeare_rolling", "shakespeare_gen"}
    samples = [json.loads(line) for line in (out / "samples_shakespeare_mc.jsonl").read_text().splitlines()]
    assert len(samples) == 4

    model, encode = gpt_from_checkpoint(modern).eval(), gpt2_encoding().encode_ordinary
    correct = 0
    for sample in samples:
        scores = []
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"], strict=True):
            whole = encode(context + continuation)
            n = len(whole) - len(encode(context))
            with torch.no_grad():
                logits, _ = model(torch.tensor([whole[:-1]]))  # (1, T, V)
            logprobs = torch.log_softmax(logits[0, -n:], dim=-1).gather(1, torch.tensor(whole[-n:])[:, None])
            assert loglikelihood == pytest.approx(float(logprobs.sum()), abs=2e-4)
            scores.append(float(logprobs.sum()))
        correct += max(range(len(scores)), key=scores.__getitem__) == sample["target"]
    assert results["results"]["shakespeare_mc"]["acc,none"] == pytest.approx(correct / 4)


def test_a_dataset_that_cannot_be_downloaded_is_one_clear_error(setup, monkeypatch):
    import datasets

    from gpt_lightning.errors import UserError
    from gpt_lightning.evaluation.harness_model import GPTHarnessLM
    from gpt_lightning.evaluation.tasks import run_tasks

    root, gpt2, _ = setup
    (root / "hub").mkdir()
    (root / "hub" / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: someone/not_cached_here\ntest_split: test\n" + TASKS["shakespeare_mc"]
    )
    monkeypatch.setattr(
        datasets.config, "HF_HUB_OFFLINE", True
    )  # what HF_DATASETS_OFFLINE=1 sets; no network here either
    with pytest.raises(
        UserError, match="not in the Hugging Face cache and cannot be downloaded .*someone/not_cached_here"
    ):
        run_tasks(GPTHarnessLM.from_checkpoint(gpt2), ["hub_task"], include_path=root / "hub")


def test_generate_until_samples_as_gen_kwargs_say(setup):
    """``do_sample`` draws from the model (seeded: reproducible), greedy otherwise, ``top_p`` from the nucleus."""
    from lm_eval.api.instance import Instance

    from gpt_lightning.evaluation.harness_model import GPTHarnessLM

    _, gpt2, _ = setup
    lm = GPTHarnessLM.from_checkpoint(gpt2, batch_size=2)

    def generate(**gen_kwargs):
        requests = [
            Instance("generate_until", {}, (prompt, {"until": ["\n\n"], "max_gen_toks": 20, **gen_kwargs}), i)
            for i, prompt in enumerate(["First Citizen:", "What, art thou"])
        ]
        torch.manual_seed(0)
        return lm.generate_until(requests)

    lm.gpt.train()  # as a model being trained is: answered in eval mode, handed back training
    greedy = generate(do_sample=False)
    assert lm.gpt.training
    assert generate() == greedy  # the harness's default: greedy
    sampled = generate(do_sample=True, temperature=1.0, top_k=50)
    assert sampled != greedy and sampled == generate(do_sample=True, temperature=1.0, top_k=50)
    assert generate(do_sample=True, top_p=1e-6) == greedy  # a nucleus of the likeliest token alone


def test_without_lm_eval_tasks_says_how_to_install_it(setup, monkeypatch, capsys):
    from gpt_lightning.cli import main

    _, gpt2, _ = setup
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets when it is not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--tasks", "hellaswag", "--ckpt_path", str(gpt2)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert 'pip install "gpt-lightning[eval]"' in line


def test_the_speed_table_in_the_docs_is_the_committed_benchmarks():
    results = REPO / "benchmarks" / "results" / "cpu-2core"
    table = (results / "evaluation.md").read_text().strip()
    written = json.loads((results / "evaluation.json").read_text())["results"]
    assert table in (REPO / "docs" / "evaluation.md").read_text()
    for key, run in written.items():
        assert f"**{run['speedup']:.2f}x**" in table, key
    assert written["gpt2-124m/float32"]["speedup"] >= 2  # the target, at GPT-2 124M's shape in float32


EDGE_TASKS = {  # name -> the YAML's own lines, over shakespeare.jsonl
    "nucleus_gen": TASKS["shakespeare_gen"].replace("do_sample: false", "do_sample: true\n  top_p: 0.9"),
    "penalty_gen": TASKS["shakespeare_gen"].replace("do_sample: false", "repetition_penalty: 1.2"),
    "empty_prompt_gen": TASKS["shakespeare_gen"].replace('doc_to_text: "{{context}}"', 'doc_to_text: ""'),
    "blank_context": TASKS["shakespeare_next"].replace('doc_to_text: "{{context}}"', 'doc_to_text: "  "'),
    "long_continuation": TASKS["shakespeare_next"].replace("{{' ' + choices[0]}}", "{{passage}}"),
}


def eval_cli(capsys, *argv):
    """``gpt-lightning eval`` as typed, in this process: (exit code, stdout, stderr)."""
    from gpt_lightning.cli import main

    try:
        main(["eval", *argv])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def edge_tasks(setup):
    root, _, _ = setup
    folder = root / "edge_tasks"
    folder.mkdir()
    for name, body in EDGE_TASKS.items():
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {root / 'tasks' / 'shakespeare.jsonl'}\n"
            f"test_split: train\n{body}"
        )
    return folder


def test_task_files_that_ended_in_a_traceback(setup, edge_tasks, capsys):
    """Nucleus sampling, an empty generation prompt and a context of only whitespace are answered (an
    empty one starts after <|endoftext|>, as the harness's empty contexts do); a generation option we
    do not take and a continuation longer than the model's context are one line naming the task."""
    _, gpt2, _ = setup
    common = [
        "--include_path",
        str(edge_tasks),
        "--ckpt_path",
        str(gpt2),
        "--limit",
        "2",
        "--device",
        "cpu",
        "--bootstrap_iters",
        "0",
    ]
    code, out, err = eval_cli(capsys, "--tasks", "nucleus_gen,empty_prompt_gen,blank_context", *common)
    assert code == 0, err[-3000:]
    assert all(f"|{name}" in out for name in ("nucleus_gen", "empty_prompt_gen", "blank_context"))
    for task, words in (
        ("penalty_gen", "repetition_penalty"),
        ("long_continuation", "longer than the model's context of 64"),
    ):
        code, _, err = eval_cli(capsys, "--tasks", task, *common)
        assert code == 2
        assert f"Task {task}" in err.strip().splitlines()[-1] and words in err.strip().splitlines()[-1], err[-2000:]


def test_batch_size_auto_on_a_cpu_fits_a_window_in_a_quarter_of_the_available_memory(monkeypatch):
    """A whole window's logits, their float32 copy and log-softmax (3 x 4 bytes a logit) for each row,
    in a quarter of Linux's MemAvailable (free pages and the page cache it would drop)."""
    from gpt_lightning.evaluation import harness_model
    from gpt_lightning.model import GPT, GPTConfig

    lm = harness_model.GPTHarnessLM(GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16)))
    row = 16 * 256 * 12
    for memory, expected in ((4 * 8 * row, 8), (4 * 8 * row - 1, 4), (4 * 64 * row, 64), (0, 1)):
        monkeypatch.setattr(harness_model, "available_memory", lambda memory=memory: memory)
        assert lm.auto_batch_size() == expected, memory
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        monkeypatch.undo()
        available = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if "MemAvailable" in line)
        assert abs(harness_model.available_memory() - available * 1024) < 2**30  # read again: it moves a little


def test_the_harness_flags(setup, tmp_path, capsys, monkeypatch):
    """``--gen_kwargs`` (parsed as the harness does) over the task's own, ``--seed`` as the harness's
    four seeds, ``--batch_size auto``, ``--output_path`` to a file of any name; ``--num_fewshot -1`` refused."""
    from gpt_lightning.evaluation import harness_model

    root, gpt2, _ = setup
    monkeypatch.setattr(harness_model, "available_memory", lambda: 2**50)  # the pick from memory: tested apart
    new_tokens, generate = [], harness_model.generate
    monkeypatch.setattr(
        harness_model,
        "generate",
        lambda model, idx, new, **kwargs: new_tokens.append(new) or generate(model, idx, new, **kwargs),
    )
    out = tmp_path / "scores.txt"
    code, stdout, err = eval_cli(
        capsys,
        "--tasks",
        "shakespeare_gen",
        "--include_path",
        str(root / "tasks"),
        "--ckpt_path",
        str(gpt2),
        "--limit",
        "3",
        "--device",
        "cpu",
        "--bootstrap_iters",
        "0",
        "--gen_kwargs",
        "max_gen_toks=2",
        "--seed",
        "0,None,8",
        "--batch_size",
        "auto",
        "--output_path",
        str(out),
        "--log_samples",
    )
    assert code == 0, err[-3000:]
    assert "--batch_size auto: 64" in stdout  # a tiny model: the largest tried
    results = json.loads(out.read_text())  # the file itself, not a folder of that name
    config = results["config"]
    assert (config["random_seed"], config["numpy_seed"], config["torch_seed"], config["fewshot_seed"]) == (
        0,
        None,
        8,
        1234,
    )
    assert results["configs"]["shakespeare_gen"]["generation_kwargs"]["max_gen_toks"] == 2
    assert (tmp_path / "samples_shakespeare_gen.jsonl").is_file()
    assert new_tokens and set(new_tokens) == {2}  # the task's own max_gen_toks is 12

    code, _, err = eval_cli(capsys, "--tasks", "shakespeare_gen", "--ckpt_path", str(gpt2), "--num_fewshot", "-1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--num_fewshot must be 0 or more" in err


def test_the_largest_batch_size_that_fits_halves_until_one_does():
    from gpt_lightning.evaluation.harness_model import largest_batch_size

    assert largest_batch_size(lambda size: size <= 12, 64) == 8
    assert largest_batch_size(lambda size: False, 64) == 1


def test_a_stopped_evaluation_resumes_from_its_cache(setup, tmp_path, capsys, monkeypatch):
    """``--use_cache``: each batch's answers are kept as it finishes; run again, only the rest is scored,
    and a third run scores nothing."""
    from gpt_lightning.evaluation import harness_model

    root, gpt2, _ = setup
    scored, stop_after = [], [1]

    def counting(model, requests, batch_size, device, on_batch=None):
        def done(indices, answers):
            on_batch(indices, answers)
            scored.extend(indices)
            if stop_after and len(scored) >= stop_after[0] * batch_size:
                raise KeyboardInterrupt  # as Ctrl-C mid-run

        return score(model, requests, batch_size, device, on_batch=done)

    score = harness_model.score_continuations
    monkeypatch.setattr(harness_model, "score_continuations", counting)
    argv = [
        "--tasks",
        "shakespeare_mc",
        "--include_path",
        str(root / "tasks"),
        "--ckpt_path",
        str(gpt2),
        "--limit",
        "5",
        "--device",
        "cpu",
        "--bootstrap_iters",
        "0",
        "--batch_size",
        "4",
        "--use_cache",
        str(tmp_path / "cache"),
    ]
    code, _, err = eval_cli(capsys, *argv)
    assert (code, err.strip().splitlines()[-1]) == (130, "gpt-lightning: stopped by Ctrl-C (SIGINT).")
    assert len(scored) == 4  # one batch of the 20 requests (5 examples, 4 choices)
    stop_after.clear()
    code, first, err = eval_cli(capsys, *argv)
    assert code == 0, err[-3000:]
    assert len(scored) == 20  # the other 16
    code, second, _ = eval_cli(capsys, *argv)
    assert code == 0 and len(scored) == 20  # nothing scored
    table = [line for line in first.splitlines() if line.startswith("|shakespeare_mc")]
    assert table and table == [line for line in second.splitlines() if line.startswith("|shakespeare_mc")]


def test_eval_help_is_quick():
    """``eval --help`` imports neither torch nor the harness (seconds on 2 cores)."""
    probe = (
        "import sys\nfrom gpt_lightning.cli import main\ntry:\n    main(['eval', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'lm_eval', 'transformers', 'lightning') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0 and "--gen_kwargs" in result.stdout, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_eval_runs_in_bfloat16_by_default_where_the_cpu_runs_it_natively(monkeypatch, capsys):
    """``--dtype auto`` (the default): bfloat16 autocast on a CPU whose bf16 matmul is measured native, the
    checkpoint's own float32 where it is emulated, said on stderr; a dtype given is taken as it is."""
    import argparse

    from gpt_lightning.commands.eval import device_and_dtype
    from gpt_lightning.training import precision

    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 0.6)
    assert device_and_dtype(argparse.Namespace(device="cpu", dtype="auto")) == (torch.device("cpu"), torch.bfloat16)
    assert "--dtype auto: bfloat16 (this CPU runs bf16 natively" in capsys.readouterr().err
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 30.0)
    assert device_and_dtype(argparse.Namespace(device="cpu", dtype="auto")) == (torch.device("cpu"), None)
    assert "--dtype auto: float32 (this CPU emulates bf16" in capsys.readouterr().err
    assert device_and_dtype(argparse.Namespace(device="cpu", dtype="float32")) == (torch.device("cpu"), torch.float32)
