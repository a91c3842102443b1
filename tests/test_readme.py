"""Docs that rot are bugs: every shell command in README.md and docs/*.md parses, and the ones a CPU
can run in seconds do run, in the README's order and then the guides', as a new user would type them
(with small overrides). The quick start runs through the installed `gpt-lightning` console script,
as a user launches it; every other command runs in this process through the same entry point
(`gpt_lightning.cli.main`, or the user's own `main.py`), which proves the same in a fraction of the
time of one Python process per command."""

import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from conftest import REPO, tiny_flags

from gpt_lightning.cli import main

# The README, then each guide: the walkthrough runs their commands in this order.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCS = {path: path.read_text() for path in PAGES}
README = DOCS[REPO / "README.md"]
DOCS_TEXT = "\n".join(DOCS.values())  # where other tests look for what the docs quote


def blocks(language: str, text: str = DOCS_TEXT) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def shell_commands(text: str = DOCS_TEXT) -> list[list[str]]:
    """Every distinct command of every ```bash block, `a && b` split into two, comments dropped;
    a command shown in the README and again in a guide counts once."""
    commands = []
    for block in blocks("bash", text):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                if words[:cut] not in commands:
                    commands.append(words[:cut])
                words = words[cut + 1 :]
    return commands


COMMANDS = shell_commands()
INSTALL_PROGRAMS = ("python3", ".", "pip")

# Small overrides that make a README command finish in seconds on a CPU; the command is otherwise
# run exactly as written.
OVERRIDES = {
    "fit": tiny_flags(  # the tiny model on each command's own data sizes, validating and sampling at step 2
        {
            "model.val_sample_tokens": 4,
            "data.batch_size": None,
            "data.block_size": None,
            "trainer.max_steps": 2,
            "trainer.limit_val_batches": 1,
            "trainer.val_check_interval": 2,
            "throughput.warmup_steps": None,
        }
    ),
    "bench": tiny_flags(  # the suite's one compiled shape: its kernels are in the compile cache
        {
            "model.compile": None,
            "model.val_sample_tokens": None,
            "data.block_size": 32,
            "trainer.max_steps": 4,
            "throughput.warmup_steps": 1,
        }
    ),
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
    readme_commands = shell_commands(README)  # the two set-up commands are the README's own
    (pip,) = [words for words in readme_commands if words[0] == "pip"]
    assert pip in ci_commands  # CI installs exactly as the README says (quietly)
    (pytest_command,) = [words for words in readme_commands if words[1:3] == ["-m", "pytest"]]
    assert shlex.join(pytest_command) in ci.splitlines()  # then the floor's and the newest torch's tests
    assert [words for words in COMMANDS if words[0] in ("pip", "python3") or words[1:3] == ["-m", "pytest"]] == [
        words for words in readme_commands if words[0] in ("pip", "python3") or words[1:3] == ["-m", "pytest"]
    ]
    assert shutil.which("tensorboard", path=str(Path(sys.executable).parent))  # `tensorboard --logdir logs`


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_and_links_every_guide_and_every_link_resolves():
    assert len(README.splitlines()) < 250
    linked = set()
    for page, text in DOCS.items():
        prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
            if page.name == "README.md":
                linked.add(file)
            if fragment and file.suffix == ".md":
                headings = re.findall(
                    r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.DOTALL), flags=re.M
                )
                assert fragment in {anchor(h) for h in headings}, f"{page.relative_to(REPO)}: no heading for {target}"
    assert set(PAGES[1:]) <= linked, "a guide in docs/ that the README does not link"
    assert (REPO / "CHANGELOG.md") in linked


@pytest.mark.parametrize("words", [w for w in COMMANDS if w[0] == "gpt-lightning" and needs_gpus(w)], ids=shlex.join)
def test_gpu_commands_parse(words, capfd, monkeypatch):
    from gpt_lightning.commands import bench

    def in_this_process(name, args, cold):  # bench's run parses as its child process would, without a launch
        return {"name": name, "args": args, **bench.train_one(args)}

    monkeypatch.setattr(bench, "run_in_subprocess", in_this_process)
    with pytest.raises(SystemExit) as exit_info:
        main([*words[1:], "--print_config"])
    assert exit_info.value.code == 0, capfd.readouterr().err
    assert "model:" in capfd.readouterr().out  # bench: printed by its (first) run's parser


def test_eval_commands_that_need_the_network_parse():
    """The docs' eval commands in ``text`` blocks (harness datasets from the hub, a GPU): the flags are real."""
    from gpt_lightning.commands.eval import parser

    commands = [shlex.split(line, comments=True) for block in blocks("text") for line in block.splitlines()]
    commands = [words for words in commands if words[:2] == ["gpt-lightning", "eval"]]
    assert len(commands) >= 5, commands
    for words in commands:
        parser().parse_args(words[2:])


def run_console_script(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The installed `gpt-lightning` script, launched as a user launches it."""
    script = Path(sys.executable).parent / words[0]
    assert script.is_file(), f"pip installed no {words[0]} script beside {sys.executable}"
    return subprocess.run([str(script), *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)


def run_in_process(words: list[str]) -> int:
    """`gpt-lightning ...` through the console script's own entry point, or `python main.py ...` (the
    user's stock LightningCLI script) as __main__; the exit code. The environment is restored after
    (Lightning exports its seed and ports), so each command starts as a fresh process would."""
    saved = dict(os.environ)
    try:
        if words[0] == "python":
            with mock.patch.object(sys, "argv", words[1:]):
                runpy.run_path(words[1], run_name="__main__")
        else:
            main(words[1:])
    except SystemExit as exit_info:
        return exit_info.code if isinstance(exit_info.code, int) else (0 if exit_info.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return 0


@pytest.mark.filterwarnings("ignore:No seed found")  # main.py: a stock LightningCLI() given no seed, as users run it
def test_the_readme_walkthrough_runs_on_a_cpu(tmp_path, shakespeare, monkeypatch, capfd, in_process_group):
    # What the README asks the user to have: the repository's configs, their own text and folders.
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "my_corpus.txt").write_text(shakespeare[:60_000])
    (tmp_path / "my_texts").mkdir()
    (tmp_path / "my_texts" / "plays.txt").write_text(shakespeare)
    parquet = pytest.importorskip("pyarrow.parquet")  # FineWeb-edu's layout: a text column among others
    (tmp_path / "fineweb-edu" / "sample" / "10BT").mkdir(parents=True)
    parquet.write_table(
        __import__("pyarrow").table(
            {"text": [shakespeare[i : i + 5000] for i in range(0, 300_000, 5000)], "score": [3.0] * 60}
        ),
        tmp_path / "fineweb-edu" / "sample" / "10BT" / "000_00000.parquet",
    )
    (main_py,) = [b for b in blocks("python") if b.startswith("# main.py")]
    (tmp_path / "main.py").write_text(main_py)
    (my_config,) = [b for b in blocks("yaml") if "class_path: gpt_lightning.GPTLightningModule" in b]
    (tmp_path / "my_config.yaml").write_text(my_config)
    example = {"ctx": "The king rose and", "endings": ["spoke.", "wept.", "sat down.", "left the hall."], "label": 0}
    (tmp_path / "hellaswag_val.jsonl").write_text(
        (json.dumps(example) + "\n") * 3
    )  # its format; the real one is 10,042 lines
    (my_task,) = [
        b for b in blocks("yaml") if b.startswith("# my_tasks/my_task.yaml")
    ]  # docs/evaluation.md's, as written
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "my_task.yaml").write_text(my_task)
    choices = {"context": "The king rose and", "choices": ["spoke.", "wept.", "sat down."], "label": 0}
    (tmp_path / "my_tasks" / "my_task.jsonl").write_text((json.dumps(choices) + "\n") * 3)
    monkeypatch.chdir(tmp_path)
    from gpt_lightning.commands import bench

    def in_this_process(name, args, cold):  # bench's runs here; tests/test_gpu_run.py launches real children
        import torch._dynamo

        torch._dynamo.reset()  # as in a new process: nothing compiled yet
        return {"name": name, "args": args, **bench.train_one(args)}

    monkeypatch.setattr(bench, "run_in_subprocess", in_this_process)

    ran = []
    for words in COMMANDS:
        if words[0] in INSTALL_PROGRAMS or words[0] in ("tensorboard", "bash") or words[1:3] == ["-m", "pytest"]:
            continue  # checked above
        if words[0] == "gpt-lightning" and needs_gpus(words):
            continue  # parsed above
        command = words[1] if words[0] == "gpt-lightning" else "fit"
        extra = list(OVERRIDES[command])
        if command == "fit" and "--ckpt_path" in words:
            extra += ["--trainer.max_steps", "4"]  # resume past the 2 steps the checkpoint has
        if words[0] == "python":
            extra = ["--trainer.max_steps", "2"]
        if not ran:  # the quick start: the one launch of the installed console script
            assert words == ["gpt-lightning", "fit", "--config", "configs/tiny-cpu.yaml"], words
            result = run_console_script([*words, *extra], tmp_path)
            assert result.returncode == 0, f"{shlex.join(words)}\n{result.stderr[-3000:]}"
        else:
            code = run_in_process([*words, *extra])
            assert code == 0, f"{shlex.join(words)}\n{capfd.readouterr().err[-3000:]}"
        ran.append(shlex.join(words))

    assert len(ran) >= 8, ran
    assert (tmp_path / "tiny.safetensors").is_file()
    assert list((tmp_path / "my_shards").glob("*train*.npy"))
    assert len(list((tmp_path / "logs" / "tiny-cpu").iterdir())) >= 4  # quick start, own text, resume, shards

    # The docs' Python snippets, in the same folder, with the files they name, as a script each.
    shutil.copy(tmp_path / "logs" / "tiny-cpu" / "version_0" / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt")
    snippets = [code for code in blocks("python") if not code.startswith("# main.py")]  # main.py ran above
    assert len(snippets) >= 4
    for code in snippets:
        # Shrunk in steps only, as the commands are: a Trainer's max_steps=50 becomes 4 (3 of them warm-up).
        code = re.sub(r"\bmax_steps=\d+", "max_steps=4", code)
        exec(compile(code, "<snippet from the docs>", "exec"), {"__name__": "__main__"})
