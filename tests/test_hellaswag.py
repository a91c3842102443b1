"""HellaSwag scoring: the arithmetic checked by hand on a tiny model, answers a hand-built model must
get right, the offline error, and `gpt-lightning eval` on a file the test writes."""

import json
import urllib.request

import pytest
import torch
import torch.nn.functional as F

from gpt_lightning.cli import main
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.hellaswag_callback import HellaSwagEval
from gpt_lightning.interop import hellaswag
from gpt_lightning.model import GPT, GPTConfig

ENCODE = gpt2_encoding().encode_ordinary
EXAMPLE = hellaswag.Example(
    "A man is sitting on a roof. He",
    (
        "starts pulling up roofing.",
        "is ripping level tiles off.",
        "is holding a rubik's cube.",
        "starts pulling up the roof.",
    ),
    3,
)


# configs/modern-tiny-cpu.yaml's switches (docs/modern.md)
MODERN = dict(
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


@pytest.mark.parametrize("switches", [{}, MODERN], ids=["gpt2", "modern"])
def test_scoring_matches_a_hand_computation(switches):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16, **switches)).eval()
    if switches:  # off the modern init's zero head and projections, which would score every ending alike
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    mean, summed = hellaswag.ending_losses(model, hellaswag.make_batch([EXAMPLE], ENCODE, 64))
    context = ENCODE(EXAMPLE.context)
    for i, ending in enumerate(EXAMPLE.endings):
        ids = context + ENCODE(" " + ending)
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]))
        # Token j of the ending is predicted at position len(context) + j - 1.
        per_token = [
            F.cross_entropy(logits[0, len(context) + j - 1], torch.tensor(ids[len(context) + j])).item()
            for j in range(len(ids) - len(context))
        ]
        assert summed[i].item() == pytest.approx(sum(per_token), abs=1e-4)
        assert mean[i].item() == pytest.approx(sum(per_token) / len(per_token), abs=1e-5)
    assert len(set(summed.tolist())) == 4  # the endings are told apart


def model_that_always_says(token: int) -> GPT:
    """Blocks that add nothing and a final LayerNorm with zero gain: every position's logits are
    wte @ ln_f.bias, which the hand-set rows make huge for `token` alone."""
    model = GPT(GPTConfig(block_size=128, vocab_size=50257, n_layer=1, n_head=1, n_embd=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight[token, 0] = 1.0
        model.transformer.ln_f.bias[0] = 20.0
    return model


def write_examples(path, examples):
    path.write_text(
        "".join(json.dumps({"ctx": e.context, "endings": list(e.endings), "label": e.label}) + "\n" for e in examples)
    )
    return path


def test_a_model_that_prefers_an_ending_chooses_it(tmp_path):
    (the,) = ENCODE(" the")
    examples = []
    for label in (0, 3, 1, 2):
        endings = ["quickly ran home.", "ate an apple.", "sang a song."]
        endings.insert(label, "the the the")  # the only ending made of the model's favourite token
        examples.append(hellaswag.Example("She looked at the sky and", tuple(endings), label))
    path = write_examples(tmp_path / "val.jsonl", examples)
    result = hellaswag.evaluate(model_that_always_says(the), hellaswag.read_examples(path), ENCODE, torch.device("cpu"))
    assert result == {"acc_norm": 1.0, "acc": 1.0, "examples": 4}


def test_offline_without_the_file_says_where_to_put_it(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(UserError, match=r"put it at .*hellaswag_val\.jsonl, or pass it with --data_file"):
        hellaswag.validation_file(tmp_path)
    assert not (tmp_path / "hellaswag").exists()


def test_the_eval_command_on_a_checkpoint(tmp_path, capsys, monkeypatch):
    model = model_that_always_says(ENCODE(" the")[0])
    ckpt = tmp_path / "always-the.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"block_size": 128, "vocab_size": 50257, "n_layer": 1, "n_head": 1, "n_embd": 8},
        },
        ckpt,
    )
    path = write_examples(
        tmp_path / "val.jsonl", [EXAMPLE, hellaswag.Example("Then", ("a b", "the the", "c d", "e f"), 1)]
    )
    main(
        [
            "eval",
            "--task",
            "hellaswag",
            "--ckpt_path",
            str(ckpt),
            "--data_file",
            str(path),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert "hellaswag: acc_norm" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["examples"] == 2 and saved["acc_norm"] >= 0.5  # the second example it cannot miss

    # --dtype as for --tasks: bfloat16 under autocast, float32 without (it was bf16 on CUDA, fp32 on a CPU).
    scored_in = []
    ending_losses = hellaswag.ending_losses

    def recording(model, batch):
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        scored_in.append((next(model.parameters()).dtype, autocast))
        return ending_losses(model, batch)

    monkeypatch.setattr(hellaswag, "ending_losses", recording)
    for dtype in ("bfloat16", "float32"):
        main(["eval", "--task", "hellaswag", "--ckpt_path", str(ckpt), "--data_file", str(path), "--dtype", dtype])
    assert scored_in == [(torch.float32, torch.bfloat16), (torch.float32, None)]


def test_a_malformed_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ctx": "x", "endings": ["a", "b"], "label": 0}\n')
    with pytest.raises(UserError, match="bad.jsonl, line 1: expected 4 endings"):
        list(hellaswag.read_examples(path))


WORDS = (
    "the king rode out across a field of wheat while his men sang and the queen waited by the gate "
    "for news of war or peace that never came before winter"
).split()


def synthetic_examples(n, seed=0):
    """HellaSwag-shaped examples of random words: contexts and endings of varied lengths."""
    g = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        count = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (count,), generator=g))

    return [
        hellaswag.Example(
            words(3, 20).capitalize(),
            tuple(words(1, 12) + "." for _ in range(4)),
            int(torch.randint(0, 4, (1,), generator=g)),
        )
        for _ in range(n)
    ]


def todays_scores(model, examples, block_size):
    """The scorer before batching: one example (4 rows) per forward pass, every position's loss."""
    for example in examples:
        tokens, mask = hellaswag.render(example, ENCODE)
        tokens, mask = tokens[:, -block_size:], mask[:, -block_size:]
        with torch.no_grad():
            logits, _ = model(tokens)
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(4, -1)
        ending = mask[:, 1:].float()
        summed = (losses * ending).sum(dim=1)
        yield summed / ending.sum(dim=1), summed


def test_batched_scoring_gives_todays_losses_and_counts(tmp_path):
    torch.manual_seed(1)  # a seed whose random model gets some examples right and some wrong
    model = GPT(GPTConfig(block_size=32, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)).eval()
    examples = synthetic_examples(7)
    reference = list(todays_scores(model, examples, 32))  # some examples are cut to 32 tokens
    expected_norm = sum(int(mean.argmin() == e.label) for (mean, _), e in zip(reference, examples))
    expected = sum(int(summed.argmin() == e.label) for (_, summed), e in zip(reference, examples))
    path = write_examples(tmp_path / "val.jsonl", examples)
    for batch_size in (1, 3, 8):  # one example a pass, a partial last batch, all in one
        batches = hellaswag.batches(examples, ENCODE, 32, batch_size)
        mean, summed = (torch.cat(parts) for parts in zip(*(hellaswag.ending_losses(model, b) for b in batches)))
        torch.testing.assert_close(mean, torch.cat([m for m, _ in reference]), rtol=0, atol=1e-5)
        torch.testing.assert_close(summed, torch.cat([s for _, s in reference]), rtol=0, atol=1e-4)
        result = hellaswag.evaluate(
            model, hellaswag.read_examples(path), ENCODE, torch.device("cpu"), batch_size=batch_size
        )
        assert result == {"acc_norm": expected_norm / 7, "acc": expected / 7, "examples": 7}
    assert 0 < expected_norm < 7  # a random model: the counts are not trivially all or none


def tiny_fit(tmp_path, small_text, callback, precision="bf16-mixed", max_steps=3):
    from conftest import TINY_MODEL
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from gpt_lightning import GPTLightningModule, TokenStreamDataModule

    torch.manual_seed(0)
    module = GPTLightningModule(**TINY_MODEL, val_sample_tokens=0)
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.1, cache_dir=str(tmp_path)
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        precision=precision,
        logger=CSVLogger(tmp_path, name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callback if isinstance(callback, list) else [callback],
        default_root_dir=tmp_path,
        log_every_n_steps=1,
    )
    trainer.fit(module, data)
    return module, trainer


def test_the_callback_scores_during_training_and_logs(tmp_path, small_text):
    import csv

    path = write_examples(tmp_path / "val.jsonl", synthetic_examples(6))
    callback = HellaSwagEval(str(path), every_n_steps=2, limit=5, batch_size=2)
    module, trainer = tiny_fit(tmp_path, small_text, callback)  # bf16-mixed, as configs/tiny-cpu.yaml
    assert [r["step"] for r in callback.results] == [0, 2, 3]  # at step 0, every 2 steps and at the end
    assert all(r["examples"] == 5 for r in callback.results)
    (metrics,) = (tmp_path / "csv").glob("version_*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("eval/hellaswag_acc_norm")]
    assert [int(r["step"]) for r in rows] == [0, 2, 3]
    assert [float(r["eval/hellaswag_acc"]) for r in rows] == pytest.approx([r["acc"] for r in callback.results])


def test_without_the_file_the_callback_says_where_to_put_it_and_training_goes_on(tmp_path, small_text):
    callback = HellaSwagEval(str(tmp_path / "missing.jsonl"))
    with pytest.warns(UserWarning, match=r"HellaSwag evaluation is off: .*missing\.jsonl does not exist.*download"):
        tiny_fit(tmp_path, small_text, callback, max_steps=1)
    assert callback.results == []
    with pytest.raises(UserError, match="every_n_steps must be at least 1"):
        HellaSwagEval(every_n_steps=0)


def test_two_processes_split_the_examples_and_count_what_one_process_counts(tmp_path, small_text):
    """Through the CLI, as a user adds the callback: DDP on 2 CPU processes (gloo), 5 examples
    split 3 + 2, the counts summed over ranks and equal to one process scoring the same weights."""
    from conftest import TINY_FIT, tiny_flags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_cli import REPO, run_cli

    from gpt_lightning.interop.checkpoint import gpt_from_checkpoint

    path = write_examples(tmp_path / "val.jsonl", synthetic_examples(5))
    evaluator = {
        "class_path": "gpt_lightning.HellaSwagEval",
        "init_args": {"data_file": str(path), "every_n_steps": 1000, "limit": 5, "batch_size": 2},
    }
    probe = {"class_path": "hellaswag_probe.RecordHellaSwag", "init_args": {"out_dir": str(tmp_path / "ranks")}}
    result = run_cli(
        *TINY_FIT,
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        *tiny_flags(
            {
                "trainer.precision": "32-true",
                "data.data_path": small_text,
                "data.block_size": 32,
                "trainer.max_steps": 2,
                "checkpoint.every_n_train_steps": 2,
                "trainer.logger.init_args.save_dir": tmp_path / "tb",
            }
        ),
        f"--trainer.callbacks+={json.dumps(evaluator)}",
        f"--trainer.callbacks+={json.dumps(probe)}",
        cwd=tmp_path,
        env_extra={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [[e["examples_here"] for e in r["results"]] for r in ranks] == [[3, 3], [2, 2]]  # steps 0 and 2
    assert ranks[0]["results"] == [{**e, "examples_here": 3} for e in ranks[1]["results"]]  # the same sums
    final = ranks[0]["results"][-1]
    assert (final["step"], final["examples"]) == (2, 5)

    (ckpt,) = (tmp_path / "tb").glob("tiny-cpu/version_*/checkpoints/last.ckpt")
    alone = hellaswag.evaluate(gpt_from_checkpoint(ckpt), hellaswag.read_examples(path), ENCODE, torch.device("cpu"))
    assert alone == {"acc_norm": final["acc_norm"], "acc": final["acc"], "examples": 5}
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = events.Scalars("eval/hellaswag_acc_norm")
    assert [e.step for e in logged] == [0, 2]
    assert [e.value for e in logged] == pytest.approx([r["acc_norm"] for r in ranks[0]["results"]])


def test_the_fineweb_recipe_attaches_the_callback(small_text, tmp_path, monkeypatch):
    from conftest import REPO

    from gpt_lightning.lightning_cli import GPTLightningCLI

    monkeypatch.chdir(tmp_path)
    cli = GPTLightningCLI(
        args=[
            "--config",
            str(REPO / "configs/gpt2-124m-fineweb.yaml"),
            "--trainer.accelerator",
            "cpu",
            "--data.data_path",
            str(small_text),
            "--trainer.logger",
            "false",
        ],
        run=False,
    )
    (evaluator,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, HellaSwagEval)]
    assert (evaluator.every_n_steps, evaluator.data_file) == (250, None)  # the cache's copy, as build-nanogpt's cadence
