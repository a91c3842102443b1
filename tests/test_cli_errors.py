"""A hurried user's mistakes at the command line: each is exit code 2 and one short error line that
names the offending file or option, never a traceback, and never a half-written file."""

from pathlib import Path

import pytest
import torch
from conftest import ONE_QUIET_CPU_STEP, TINY_CPU, TINY_MODEL
from lightning.pytorch import Trainer

from gpt_lightning.cli import main
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.training.module import GPTLightningModule


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, capsys.readouterr().err


def assert_one_clear_line(code, err, *expected):
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for text in expected:
        assert text in errors[0], errors[0]


def fit_args(tmp_path, *extra):
    return [
        "fit",
        "--config",
        TINY_CPU,
        "--model.compile",
        "false",
        "--trainer.max_steps",
        "1",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "tb"),
        *extra,
    ]


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory, shakespeare):
    """A real 1-step checkpoint of a tiny model."""
    root = tmp_path_factory.mktemp("good")
    (root / "text.txt").write_text(shakespeare[:5_000])
    module = GPTLightningModule(**TINY_MODEL, block_size=16)
    data = TokenStreamDataModule(
        str(root / "text.txt"), batch_size=2, block_size=16, val_fraction=0.0, cache_dir=str(root)
    )
    trainer = Trainer(**ONE_QUIET_CPU_STEP)
    trainer.fit(module, data)
    trainer.save_checkpoint(root / "good.ckpt")
    return root / "good.ckpt"


def bad_checkpoints(tmp_path: Path, good: Path) -> dict[str, Path]:
    files = {
        "missing": tmp_path / "missing.ckpt",
        "corrupt": tmp_path / "corrupt.ckpt",
        "truncated": tmp_path / "truncated.ckpt",
        "directory": tmp_path,
        "foreign": tmp_path / "foreign.ckpt",
    }
    files["corrupt"].write_bytes(b"\x80\x04not a pickle at all" * 50)
    files["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torch.save({"weights": torch.zeros(3)}, files["foreign"])
    return files


MESSAGES = {
    "missing": "does not exist",
    "corrupt": "cannot be read",
    "truncated": "cannot be read",
    "directory": "is a directory",
    "foreign": "is not a gpt-lightning checkpoint",
}


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_fit_with_a_bad_checkpoint(kind, good_ckpt, tmp_path, capsys):
    ckpt = bad_checkpoints(tmp_path, good_ckpt)[kind]
    code, err = run_main(fit_args(tmp_path, "--ckpt_path", str(ckpt)), capsys)
    assert_one_clear_line(code, err, MESSAGES[kind], str(ckpt))
    assert "weights_only" not in err
    assert not (tmp_path / "tb").exists()  # refused before anything was written


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "foreign"])
@pytest.mark.parametrize("command", ["sample", "export"])
def test_sample_and_export_with_a_bad_checkpoint(command, kind, good_ckpt, tmp_path, capsys):
    ckpt = bad_checkpoints(tmp_path, good_ckpt)[kind]
    out = tmp_path / "out" / "weights.safetensors"
    extra = ["--out", str(out)] if command == "export" else ["--max_new_tokens", "2"]
    code, err = run_main([command, "--ckpt_path", str(ckpt), *extra], capsys)
    assert_one_clear_line(code, err, MESSAGES[kind], str(ckpt))
    assert not out.parent.exists() or not list(out.parent.iterdir())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--max_new_tokens", "-3"], "--max_new_tokens must be at least 0"),
        (["--num_samples", "0"], "--num_samples must be at least 1"),
        (["--top_k", "-1"], "--top_k must be at least 0"),
        (["--device", "gpu7"], "--device 'gpu7' is not a device"),
        (["--device", "mps"], "--device mps: gpt-lightning samples and evaluates on cpu or cuda"),
        (["--device", "meta"], "--device meta: gpt-lightning samples and evaluates on cpu or cuda"),
    ],
)
def test_sample_with_bad_options(args, expected, good_ckpt, capsys):
    code, err = run_main(["sample", "--ckpt_path", str(good_ckpt), *args], capsys)
    assert_one_clear_line(code, err, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_sample_on_cuda_without_a_gpu(good_ckpt, capsys):
    code, err = run_main(["sample", "--ckpt_path", str(good_ckpt), "--device", "cuda"], capsys)
    assert_one_clear_line(code, err, "no CUDA GPU is available here")


def test_vocab_smaller_than_the_tokenizer(tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, "--model.vocab_size", "1000"), capsys)
    assert_one_clear_line(
        code, err, "model.vocab_size (1000) is smaller than the tokenizer's 50257", "--model.vocab_size 50257"
    )


@pytest.mark.parametrize("option", ["--trainer.max_steps", "--trainer.max_epochs"])
def test_zero_steps_is_a_mistake(option, tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, option, "0"), capsys)
    assert_one_clear_line(code, err, f"{option[2:]} is 0: nothing would be trained")


def test_heads_that_do_not_divide_the_width(tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, "--model.n_head", "5"), capsys)
    assert_one_clear_line(code, err, "model.n_embd (128) must be divisible by n_head (5)")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.n_layers", "3"], "unrecognized arguments: --model.n_layers 3. Did you mean --model.n_layer?"),
        (
            ["--model.learning_rate", "abc"],
            "Parser key \"model.learning_rate\": Expected a <class 'float'>. Got value: abc",
        ),
        (["--trainer.precision", "bf17"], "trainer.precision"),
        (["--config", "no-such-file.yaml"], "File does not exist"),
    ],
    ids=["misspelt-option", "not-a-number", "bad-precision", "missing-config"],
)
def test_argument_errors_are_one_line_and_a_hint(args, expected, tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, *args), capsys)
    assert_one_clear_line(code, err, expected)
    assert len(err.strip().splitlines()) == 2, err  # the error, then where to find every option
    assert err.strip().splitlines()[1] == "Every option: gpt-lightning fit --help"


def test_misspelt_subcommand(capsys):
    code, err = run_main(["fitt", "--config", TINY_CPU], capsys)
    assert_one_clear_line(code, err, "invalid choice: 'fitt'")
    assert len(err.strip().splitlines()) == 2


@pytest.mark.parametrize(
    "command, expected",
    [
        (["export", "--out", "{dir}"], "Cannot write {dir}: it is a directory. Give a file path"),
        (
            ["export", "--format", "hf", "--out", "{file}"],
            "Cannot write {file}/config.json: cannot make the folder {file}",
        ),
        (
            ["export", "--out", "{file}/x.safetensors"],
            "Cannot write {file}/x.safetensors: cannot make the folder {file}",
        ),
    ],
    ids=["file-onto-a-directory", "directory-onto-a-file", "under-a-file"],
)
def test_export_to_a_path_that_cannot_be_written(command, expected, good_ckpt, tmp_path, capsys):
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("")
    paths = {"dir": str(tmp_path / "a-dir"), "file": str(tmp_path / "a-file")}
    code, err = run_main([command[0], "--ckpt_path", str(good_ckpt), *(w.format(**paths) for w in command[1:])], capsys)
    assert_one_clear_line(code, err, expected.format(**paths))
    assert not list(tmp_path.glob("**/.*.tmp*"))  # no temporary file left behind


def test_tokenize_into_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello")
    (tmp_path / "a-file").write_text("")
    code, err = run_main(["tokenize", "--input", str(tmp_path / "texts"), "--output", str(tmp_path / "a-file")], capsys)
    assert_one_clear_line(code, err, "File exists", "a-file", "Check the paths given.")


def test_predict_is_not_offered(capsys):
    """The module has no predict_step: Lightning's `predict` would fail after building everything."""
    code, err = run_main(["predict", "--config", TINY_CPU], capsys)
    assert_one_clear_line(code, err, "invalid choice: 'predict' (choose from 'fit', 'validate', 'test')")


def test_misspelt_key_in_a_config_file(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("model:\n  n_layers: 4\n")
    code, err = run_main(fit_args(tmp_path, "--config", str(config)), capsys)
    assert_one_clear_line(code, err, "n_layers")
    assert len(err.strip().splitlines()) == 2


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("model:\n  n_layer: 4\n   n_head: [\n", "is not valid YAML at line 3, column 10"),
        ("- trainer\n- model\n", "must map sections to settings"),
        (b"model:\n  n_layer: \xff\n", "is not UTF-8 text"),
    ],
    ids=["syntax", "not-a-mapping", "not-utf8"],
)
def test_a_broken_config_file_is_named(content, expected, tmp_path, capsys):
    config = tmp_path / "broken.yaml"
    config.write_bytes(content.encode() if isinstance(content, str) else content)
    code, err = run_main(fit_args(tmp_path, "--config", str(config)), capsys)
    assert_one_clear_line(code, err, f"Config file {config} ", expected)
    assert "<unicode string>" not in err


def test_a_validation_interval_longer_than_an_epoch(tmp_path, capsys):
    code, err = run_main(
        fit_args(tmp_path, "--trainer.val_check_interval", "100000", "--trainer.check_val_every_n_epoch", "1"), capsys
    )
    assert_one_clear_line(
        code,
        err,
        "trainer.val_check_interval (100000) is more than the 297 training batches",
        "--trainer.check_val_every_n_epoch null",
    )


def test_a_validation_interval_in_optimizer_steps_longer_than_an_epoch(tmp_path, capsys):
    """With tokens_per_step (4 micro-batches a step here) the interval is counted, and named, in steps;
    the epoch is its whole steps (297 batches, 296 of them trained)."""
    code, err = run_main(
        fit_args(
            tmp_path,
            "--data.tokens_per_step",
            "4096",
            "--trainer.val_check_interval",
            "100",
            "--trainer.check_val_every_n_epoch",
            "1",
        ),
        capsys,
    )
    assert_one_clear_line(
        code,
        err,
        "trainer.val_check_interval (100 optimizer steps = 400 batches) is more than the 296 training batches",
        "validate every 100 steps across epochs, or use a val_check_interval <= 74.",
    )


def test_trainer_settings_that_cannot_be_built_here(tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, "--trainer.accelerator", "tpu"), capsys)
    assert_one_clear_line(code, err, "The trainer settings are not usable here", "torch_xla")


def test_no_command_lists_every_command(capsys):
    code, err = run_main([], capsys)
    assert code == 2
    for command in ("fit", "bench", "sample", "export", "tokenize"):
        assert command in err
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "tokenize" in capsys.readouterr().out
