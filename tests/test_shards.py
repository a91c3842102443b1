"""Shard directories in the three formats, split by name, rank-aware; the tokenize command."""

import numpy as np
import pytest
import torch
from test_data import saved_at

from gpt_lightning.cli import main
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.data.shards import LLMC_MAGIC, ShardWindows, find_shards, open_shard
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError


def write_raw_bin(path, tokens):  # nanoGPT
    np.asarray(tokens, dtype=np.uint16).tofile(path)


def write_llmc_bin(path, tokens):  # llm.c: 256 int32 header, then uint16
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [LLMC_MAGIC, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def write_npy(path, tokens):  # build-nanogpt / FineWeb-edu
    np.save(path, np.asarray(tokens, dtype=np.uint16))


WRITERS = {"raw.bin": write_raw_bin, "llmc.bin": write_llmc_bin, "npy": write_npy}


@pytest.mark.parametrize("fmt", WRITERS)
def test_each_format_reads_back_exactly(fmt, tmp_path):
    tokens = np.arange(1000, 1100)
    path = tmp_path / f"x_train_0.{fmt.split('.')[-1]}"
    WRITERS[fmt](path, tokens)
    assert np.array_equal(np.asarray(open_shard(path)), tokens)


def test_truncated_llmc_shard_is_a_clear_error(tmp_path):
    path = tmp_path / "t_train.bin"
    write_llmc_bin(path, np.arange(100))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UserError, match="truncated"):
        open_shard(path)


def test_windows_run_shard_after_shard_and_never_straddle(tmp_path):
    write_npy(tmp_path / "a_train_0.npy", np.arange(0, 20))  # 2 batches of B*T=8 (needs 17)
    write_llmc_bin(tmp_path / "a_train_1.bin", np.arange(100, 126))  # 3 batches
    write_raw_bin(tmp_path / "a_val_0.bin", np.arange(500, 520))
    splits = find_shards(tmp_path)
    assert [p.name for p in splits["train"]] == ["a_train_0.npy", "a_train_1.bin"]
    assert [p.name for p in splits["val"]] == ["a_val_0.bin"]
    windows = ShardWindows(splits["train"], batch_size=2, block_size=4)
    firsts = [x[0, 0].item() for x, _ in windows]
    assert len(windows) == 5 and firsts == [0, 8, 100, 108, 116]
    x, y = list(windows)[2]
    assert x.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107]] and y[0, 0].item() == 101
    # Rank-aware: two ranks split each shard's windows between them.
    per_rank = [[x[0, 0].item() for x, _ in ShardWindows(splits["train"], 2, 4, rank=r, world_size=2)] for r in (0, 1)]
    assert per_rank == [[0, 100], [8, 108]]  # each shard holds one batch per rank (2 x 8 + 1 <= 20)
    # Resuming mid-stream skips whole shards, then part of one.
    resumed = ShardWindows(splits["train"], 2, 4)
    resumed.load_state_dict(saved_at(resumed, 0, 3))
    assert [x[0, 0].item() for x, _ in resumed] == [108, 116]


def test_shuffled_shards_change_order_each_epoch_and_resume_in_it(tmp_path):
    for i in range(4):  # shard i holds ids 1000 i ... : 12 rows of 4 (+1), 3 batches of 2 x 4 per rank of 2
        write_npy(tmp_path / f"s_train_{i}.npy", np.arange(1000 * i, 1000 * i + 49))
    shards = find_shards(tmp_path)["train"]

    def epoch(e, rank=0, world=2):
        return [
            x[:, 0].tolist() for x, _ in ShardWindows(shards, 2, 4, rank, world, shuffle=True, seed=3).batches(e, 0)
        ]

    orders = [[batch[0] // 1000 for batch in epoch(e)[::3]] for e in range(4)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders) and len({tuple(o) for o in orders}) > 1
    first = epoch(0)
    assert [b[0] // 1000 for b in first] == [s for s in orders[0] for _ in range(3)]  # a shard at a time
    assert first != [[1000 * s + 16 * i, 1000 * s + 16 * i + 4] for s in orders[0] for i in range(3)]  # rows shuffled
    assert epoch(0) == first  # the same in every run
    both = epoch(0, 0) + epoch(0, 1)
    rows = [r for batch in both for r in batch]
    assert len(rows) == len(set(rows)) == 4 * 12  # ranks disjoint, every row of every shard once
    windows = ShardWindows(shards, 2, 4, 0, 2, shuffle=True, seed=3)
    windows.load_state_dict(saved_at(windows, 0, 5))
    assert [x[:, 0].tolist() for x, _ in windows] == first[5:]


def test_an_epoch_of_shards_is_a_whole_number_of_optimizer_steps(tmp_path):
    for i in range(2):  # 3 batches of 2 x 4 each: 6 an epoch, 4 of them at 4 a step
        write_npy(tmp_path / f"s_train_{i}.npy", np.arange(1000 * i, 1000 * i + 25))
    shards = find_shards(tmp_path)["train"]
    whole = [x[0, 0].item() for x, _ in ShardWindows(shards, 2, 4)]
    windows = ShardWindows(shards, 2, 4, accumulate=4)
    assert (len(windows), windows.available()) == (4, 6)
    assert [x[0, 0].item() for x, _ in windows] == whole[:4] == [0, 8, 16, 1000]  # the last shard's tail left out
    windows.load_state_dict(saved_at(windows, 0, 3))
    assert [x[0, 0].item() for x, _ in windows] == [1000]


def test_directory_without_training_shards_is_a_clear_error(tmp_path):
    write_npy(tmp_path / "only_val.npy", np.arange(10))
    with pytest.raises(UserError, match="no training shards"):
        find_shards(tmp_path)


def test_tokenize_command_then_train_windows_from_the_shards(small_text, tmp_path, capsys):
    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    content = small_text.read_text()
    (texts / "a.txt").write_text(content[:20000])
    (texts / "sub" / "b.txt").write_text(content[20000:40000])
    main(["tokenize", "--input", str(texts), "--output", str(tmp_path / "shards"), "--shard_tokens", "3000"])
    assert "shard(s)" in capsys.readouterr().out
    shards = sorted((tmp_path / "shards").glob("*.npy"), key=lambda p: p.stem[-6:])  # by shard number
    assert shards[0].name == "shard_val_000000.npy" and all("train" in p.name for p in shards[1:])

    enc = gpt2_encoding()
    expected = [
        enc.eot_token,
        *enc.encode_ordinary(content[:20000]),
        enc.eot_token,
        *enc.encode_ordinary(content[20000:40000]),
    ]
    assert np.concatenate([np.load(p) for p in shards]).tolist() == expected
    assert all(len(np.load(p)) == 3000 for p in shards[:-1])

    data = TokenStreamDataModule(str(tmp_path / "shards"), batch_size=2, block_size=64)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (2, 64) and torch.equal(x[0, 1:], y[0, :-1])
    assert x[0, 0].item() == expected[3000]  # the first training shard follows the validation shard
    assert len(data.val_dataloader()) == (3000 - 1) // 128


def test_tokenize_refuses_a_folder_that_fills_only_the_validation_shard(small_text, tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text(small_text.read_text()[:4000])  # about 1,000 tokens
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenize", "--input", str(texts), "--output", str(tmp_path / "shards"), "--shard_tokens", "100000000"])
    err = capsys.readouterr().err
    n = 1 + len(gpt2_encoding().encode_ordinary(small_text.read_text()[:4000]))  # <|endoftext|> + the text
    assert exit_info.value.code == 2 and "nothing would be left to train on" in err
    assert f"holds {n:,} tokens" in err and f"Use --shard_tokens {n // 10} (or less)" in err
    assert not list((tmp_path / "shards").glob("*.npy"))  # nothing half-made


def test_an_epoch_of_shards_is_the_same_rows_on_any_number_of_processes(tmp_path):
    """Shards of 5 and 7 rows of 4 tokens: one process reads them as one stream of 12 rows, and two
    processes split that stream batch by batch (a batch of rank 1 takes rows from both shards), where
    each shard's rows used to be cut to whole batches of the layout; resumed on 1 process after 2 steps
    of 2 processes, the rows go on in the same order."""
    write_npy(tmp_path / "s_train_0.npy", np.arange(0, 21))
    write_npy(tmp_path / "s_train_1.npy", np.arange(100, 129))
    shards = find_shards(tmp_path)["train"]
    for shuffle in (False, True):

        def rows(windows):
            return [row for x, _ in windows for row in x[:, 0].tolist()]

        one = rows(ShardWindows(shards, 2, 4, shuffle=shuffle, seed=3).batches(1, 0))
        assert len(one) == 12 and sorted(one) == [*range(0, 20, 4), *range(100, 128, 4)]
        two = [rows(ShardWindows(shards, 2, 4, r, 2, shuffle=shuffle, seed=3).batches(1, 0)) for r in (0, 1)]
        assert [row for i in range(3) for r in (0, 1) for row in two[r][2 * i : 2 * i + 2]] == one
        ranks = [ShardWindows(shards, 2, 4, r, 2, shuffle=shuffle, seed=3) for r in (0, 1)]
        for windows in ranks:
            stream = iter(windows)
            next(stream), next(stream)  # epoch 0: 2 steps of 4 rows
        resumed = ShardWindows(shards, 2, 4, shuffle=shuffle, seed=3)
        resumed.load_state_dict(ranks[0].state_dict())
        assert rows(resumed) == rows(ShardWindows(shards, 2, 4, shuffle=shuffle, seed=3).batches(0, 0))[8:]
