"""Docs that rot are bugs: every shell command in README.md parses, and the ones a CPU can run in
seconds do run, in the README's order, as a new user would type them (with small overrides)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_lightning.cli import main

from conftest import REPO

README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def shell_commands() -> list[list[str]]:
    """Every command of every ```bash block, `a && b` split into two, comments dropped."""
    commands = []
    for block in blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


COMMANDS = shell_commands()
INSTALL_PROGRAMS = ("python3", ".", "pip")

# Small overrides that make a README command finish in seconds on a CPU; the command is otherwise
# run exactly as written.
TINY_MODEL = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.compile", "false"]
OVERRIDES = {
    "fit": ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
            "--model.val_sample_tokens", "4", *TINY_MODEL],
    "bench": ["--trainer.max_steps", "4", "--throughput.warmup_steps", "1", "--trainer.limit_val_batches", "0",
              "--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--data.block_size", "32"],
    "sample": ["--max_new_tokens", "5"],
    "export": [],
    "tokenize": ["--shard_tokens", "20000"],
    "eval": ["--limit", "3"],
}


def needs_gpus(words: list[str]) -> bool:
    """Commands for CUDA, several devices or the Hugging Face hub: parsed here (--print_config), not run."""
    return any("gpt2-124m" in w or "finetune-gpt2" in w for w in words) or "--trainer.devices" in words


def test_every_command_is_one_we_know_how_to_check():
    programs = {words[0] for words in COMMANDS}
    assert programs <= {*INSTALL_PROGRAMS, "gpt-lightning", "python", "tensorboard", "bash"}, programs
    # The one bash script shown is the GPU run, which tests/test_gpu_run.py runs in its CPU smoke mode.
    assert [w for w in COMMANDS if w[0] == "bash"] == [["bash", "benchmarks/gpu_run.sh"]]
    assert '"benchmarks" / "gpu_run.sh"' in (REPO / "tests" / "test_gpu_run.py").read_text()
    assert {w[1] for w in COMMANDS if w[0] == "gpt-lightning"} <= {"fit", *OVERRIDES}


def test_the_install_and_test_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    ci_commands = [[w for w in shlex.split(line, comments=True) if w != "-q"] for line in ci.splitlines()]
    (pip,) = [words for words in COMMANDS if words[0] == "pip"]
    assert pip in ci_commands  # CI installs exactly as the README says (quietly)
    (pytest_command,) = [words for words in COMMANDS if words[1:3] == ["-m", "pytest"]]
    assert ci.rstrip().splitlines()[-1] == shlex.join(pytest_command)
    assert shutil.which("tensorboard", path=str(Path(sys.executable).parent))  # `tensorboard --logdir logs`


@pytest.mark.parametrize("words", [w for w in COMMANDS if w[0] == "gpt-lightning" and needs_gpus(w)], ids=shlex.join)
def test_gpu_commands_parse(words, capfd):
    with pytest.raises(SystemExit) as exit_info:
        main([*words[1:], "--print_config"])
    assert exit_info.value.code == 0, capfd.readouterr().err
    assert "model:" in capfd.readouterr().out  # bench prints it from its run's own process


def run(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / words[0]  # the installed console script, as a user runs it
    argv = [str(script), *words[1:]] if script.exists() else [sys.executable, "-m", "gpt_lightning", *words[1:]]
    if words[0] == "python":
        argv = [sys.executable, *words[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_walkthrough_runs_on_a_cpu(tmp_path, shakespeare):
    # What the README asks the user to have: the repository's configs, their own text and folders.
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "my_corpus.txt").write_text(shakespeare[:60_000])
    (tmp_path / "my_texts").mkdir()
    (tmp_path / "my_texts" / "plays.txt").write_text(shakespeare)
    parquet = pytest.importorskip("pyarrow.parquet")  # FineWeb-edu's layout: a text column among others
    (tmp_path / "fineweb-edu" / "sample" / "10BT").mkdir(parents=True)
    parquet.write_table(__import__("pyarrow").table({"text": [shakespeare[i:i + 5000] for i in range(0, 300_000, 5000)],
                                                     "score": [3.0] * 60}),
                        tmp_path / "fineweb-edu" / "sample" / "10BT" / "000_00000.parquet")
    (main_py,) = [b for b in blocks("python") if b.startswith("# main.py")]
    (tmp_path / "main.py").write_text(main_py)
    (tmp_path / "my_config.yaml").write_text(blocks("yaml")[0])
    example = {"ctx": "The king rose and", "endings": ["spoke.", "wept.", "sat down.", "left the hall."], "label": 0}
    (tmp_path / "hellaswag_val.jsonl").write_text((json.dumps(example) + "\n") * 3)  # its format; the real one is 10,042 lines

    ran = []
    for words in COMMANDS:
        if words[0] in INSTALL_PROGRAMS or words[0] in ("tensorboard", "bash") or words[1:3] == ["-m", "pytest"]:
            continue  # checked above
        if words[0] == "gpt-lightning" and needs_gpus(words):
            continue  # parsed above
        command = words[1] if words[0] == "gpt-lightning" else "fit"
        extra = list(OVERRIDES[command])
        if command == "fit" and "--ckpt_path" in words:
            extra[1] = "4"  # resume past the 2 steps the checkpoint has
        if words[0] == "python":
            extra = ["--trainer.max_steps", "2"]
        result = run([*words, *extra], tmp_path)
        assert result.returncode == 0, f"{shlex.join(words)}\n{result.stderr[-3000:]}"
        ran.append(shlex.join(words))

    assert len(ran) >= 8, ran
    assert (tmp_path / "tiny.safetensors").is_file()
    assert list((tmp_path / "my_shards").glob("*train*.npy"))
    assert len(list((tmp_path / "logs" / "tiny-cpu").iterdir())) >= 4  # quick start, own text, resume, shards

    # The README's Python snippets, in the same folder, with the files they name.
    shutil.copy(tmp_path / "logs" / "tiny-cpu" / "version_0" / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt")
    for code in blocks("python"):
        if code.startswith("# main.py"):
            continue  # a file, run above as `python main.py fit ...`
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{code}\n{result.stderr[-3000:]}"
