import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt_lightning.data import token_cache
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.data.windows import TokenWindows


class ReferenceLoader:
    """The reference's DataLoaderLite (with build-nanogpt's rank arguments), for comparison."""

    def __init__(self, tokens, B, T, rank=0, world=1):
        self.tokens, self.B, self.T, self.rank, self.world = torch.tensor(tokens.astype(np.int64)), B, T, rank, world
        self.pos = B * T * rank

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.pos : self.pos + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.pos += B * T * self.world
        if self.pos + B * T * self.world + 1 > len(self.tokens):
            self.pos = B * T * self.rank
        return x, y


def saved_at(windows, epoch: int, batches: int) -> dict:
    """The state ``windows`` saves after ``batches`` batches of ``epoch``, in its own layout."""
    whole = batches // windows.accumulate * windows.accumulate  # the rows count whole optimizer steps
    state = {
        "epoch": epoch,
        "batches": batches,
        "ended": batches >= len(windows),
        "rows": whole * windows.rows_per_batch,
    }
    return {**windows.state_dict(), **state}


def epochs(windows: TokenWindows, n: int):
    return [batch for _ in range(n) for batch in windows]


def test_windows_are_shifted_contiguous_slices():
    tokens = np.arange(50, dtype=np.uint16)
    windows = TokenWindows(tokens, batch_size=2, block_size=4)
    assert len(windows) == 6  # (50 - 1) // 8
    x, y = next(iter(windows))
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert x.dtype == torch.int64


def test_windows_match_the_reference_loader_across_wrap_around():
    tokens = np.arange(101, dtype=np.uint16)
    ours = epochs(TokenWindows(tokens, 2, 4), 3)
    ref = ReferenceLoader(tokens, 2, 4)
    assert len(ours) == 3 * 12
    for x, y in ours:
        rx, ry = ref.next_batch()
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_rank_r_of_w_reads_every_w_th_window_of_the_single_process_stream():
    # build-nanogpt's loader lets the last rank run one batch short (its reset test is rank-offset),
    # which would hang DDP; here every rank gets the same number of batches, all of them valid.
    tokens = np.arange(101, dtype=np.uint16)
    single = list(TokenWindows(tokens, 2, 4))
    for rank in range(2):
        ours = list(TokenWindows(tokens, 2, 4, rank=rank, world_size=2))
        assert len(ours) == 6
        for j, (x, y) in enumerate(ours):
            assert torch.equal(x, single[2 * j + rank][0]) and torch.equal(y, single[2 * j + rank][1])


def test_ranks_read_disjoint_windows():
    tokens = np.arange(101, dtype=np.uint16)
    seen = [
        {tuple(x.flatten().tolist()) for x, _ in TokenWindows(tokens, 2, 4, rank=r, world_size=2)} for r in range(2)
    ]
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    first_rank1 = next(iter(TokenWindows(tokens, 2, 4, rank=1, world_size=2)))[0]
    assert first_rank1[0, 0].item() == 8  # rank 1 starts one B*T later


def test_a_restored_position_applies_to_its_own_epoch_only():
    tokens = np.arange(101, dtype=np.uint16)
    windows = TokenWindows(tokens, 2, 4)
    windows.load_state_dict(saved_at(windows, 0, 3))
    first = [x[0, 0].item() for x, _ in windows]
    second = [x[0, 0].item() for x, _ in windows]
    assert first == [24, 32, 40, 48, 56, 64, 72, 80, 88]
    assert second[0] == 0 and len(second) == 12
    # Saved on an epoch's last batch, the position means nothing to the next epoch: it starts at 0.
    windows.load_state_dict(saved_at(windows, 0, 12))
    assert len(list(windows)) == 12 and windows.state_dict()["epoch"] == 1
    # Under a trainer, the trainer says whether the epoch goes on: with limit_train_batches it ends early.
    windows = TokenWindows(tokens, 2, 4, progress=lambda: (0, 0))
    windows.load_state_dict(saved_at(windows, 0, 7))
    assert len(list(windows)) == 12 and windows.state_dict()["epoch"] == 1
    # A checkpoint written after fit stopped mid-epoch at max_steps: the trainer counts the epoch as
    # ended (epoch 1) but goes on with its batches; the stream goes on with its own epoch 0.
    windows = TokenWindows(tokens, 2, 4, progress=lambda: (1, 3))
    windows.load_state_dict(saved_at(windows, 0, 3))
    assert next(iter(windows))[0][0, 0].item() == 24 and windows.state_dict()["epoch"] == 0


def test_the_state_counts_the_batches_served_so_far():
    windows = TokenWindows(np.arange(101, dtype=np.uint16), 2, 4)
    stream = iter(windows)
    for _ in range(5):
        next(stream)
    assert windows.state_dict() == {
        "epoch": 0,
        "batches": 5,
        "ended": False,
        "rows": 10,
        "layout": {"batch_size": 2, "processes": 1, "accumulate": 1},
        "order": {"block_size": 4, "shuffle": False, "seed": 0, "rows": [25]},
    }
    resumed = TokenWindows(np.arange(101, dtype=np.uint16), 2, 4)
    resumed.load_state_dict(windows.state_dict())
    assert resumed.state_dict()["batches"] == 5  # restored, not yet served: saved on unchanged
    assert [x[0, 0].item() for x, _ in resumed] == [x[0, 0].item() for x, _ in stream]


def test_a_position_saved_before_0_1_0_is_refused_in_one_line():
    from gpt_lightning.errors import UserError

    windows = TokenWindows(np.arange(101, dtype=np.uint16), 2, 4)
    for old in ({"epoch": 0, "batches": 3, "layout": [2, 4, 1, 101]}, {"epoch": 0, "batches": 3}):
        with pytest.raises(UserError, match=r"written by a gpt-lightning before 0\.1\.0.*start a new run"):
            windows.load_state_dict(old)


def first_rows(ranks, epoch_passes=1):
    """Each step's rows (first token of each) over all ranks, micro-batch by micro-batch, rank by rank."""
    served = [[x[:, 0].tolist() for _ in range(epoch_passes) for x, _ in windows] for windows in ranks]
    return [row for batch in zip(*served) for rows in batch for row in rows]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_position_goes_on_in_another_layout_with_the_same_rows(shuffle):
    """250 rows of 4 tokens; 2 processes x 2 rows x 2 micro-batches (8 rows a step) stopped after 5 steps,
    resumed on 1 process x 2 rows x 4: the rest of the epoch's rows, in order, whole steps; the trainer
    is told the new counts. On 12 rows a step (3 x 4) the rows go on too, from where the run stopped."""
    tokens = np.arange(1001, dtype=np.uint16)
    kw = {"shuffle": shuffle, "seed": 7}
    whole = first_rows([TokenWindows(tokens, 2, 4, **kw)], 2)  # one process, one row per batch slot
    ranks = [TokenWindows(tokens, 2, 4, rank=r, world_size=2, accumulate=2, **kw) for r in (0, 1)]
    streams = [iter(w) for w in ranks]
    for _ in range(10):  # 5 steps of 2 micro-batches
        for stream in streams:
            next(stream)
    saved = ranks[0].state_dict()
    assert saved["rows"] == 40 and saved["batches"] == 10
    moves = []
    for accumulate, done, epoch_rows in ((4, 20, 248), (6, 18, 244)):  # 31 steps of 8 rows an epoch; 20 of 12
        resumed = TokenWindows(tokens, 2, 4, accumulate=accumulate, moved=lambda *a: moves.append(a), **kw)
        resumed.load_state_dict(saved)
        rows = first_rows([resumed]) + first_rows([resumed])
        assert rows == whole[40:epoch_rows] + whole[250 : 250 + len(rows) - (epoch_rows - 40)]
        assert len(rows) - (epoch_rows - 40) == len(resumed) * 2
        assert moves.pop() == (done, 2, False)  # batches of the epoch this layout counts as done


def test_a_mid_epoch_resume_in_another_order_of_rows_is_refused_in_one_line():
    from gpt_lightning.errors import UserError

    tokens = np.arange(1001, dtype=np.uint16)
    windows = TokenWindows(tokens, 2, 4, shuffle=True, seed=7)
    stream = iter(windows)
    next(stream)
    with pytest.raises(
        UserError,
        match="mid-epoch in the order of rows that --data.block_size 4 --data.seed 7 give .this run: block_size 8, "
        "seed 8.; .*resume with --data.block_size 4 --data.seed 7, or",
    ):
        TokenWindows(tokens, 2, 8, shuffle=True, seed=8).load_state_dict(windows.state_dict())
    list(stream)  # at the epoch's end another order is the next epoch's
    TokenWindows(tokens, 2, 8, shuffle=True, seed=8).load_state_dict(windows.state_dict())


def shuffled_firsts(windows, epoch):
    return [x[:, 0].tolist() for x, _ in windows.batches(epoch, 0)]


def test_shuffled_rows_are_a_new_permutation_each_epoch_and_the_same_every_run():
    tokens = np.arange(1001, dtype=np.uint16)  # 250 rows of T + 1 = 5 tokens (row s starts at 4s)
    windows = TokenWindows(tokens, 2, 4, shuffle=True, seed=7)
    assert len(windows) == 125
    x, y = next(windows.batches(0, 0))
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)  # rows stay contiguous
    assert bool((x[:, 0] % 4 == 0).all())  # and start on row boundaries
    epoch0, epoch1 = shuffled_firsts(windows, 0), shuffled_firsts(windows, 1)
    rows0 = sorted(r // 4 for batch in epoch0 for r in batch)
    assert rows0 == list(range(250))  # every row once
    assert epoch0 != epoch1 and epoch0 != [[8 * i, 8 * i + 4] for i in range(125)]
    assert shuffled_firsts(TokenWindows(tokens, 2, 4, shuffle=True, seed=7), 0) == epoch0  # another run
    assert shuffled_firsts(TokenWindows(tokens, 2, 4, shuffle=True, seed=8), 0) != epoch0  # another seed
    # Ranks split each epoch's batches of the single-process stream: disjoint, and all of them.
    per_rank = [
        shuffled_firsts(TokenWindows(tokens, 2, 4, rank=r, world_size=2, shuffle=True, seed=7), 1) for r in (0, 1)
    ]
    assert per_rank[0] == epoch1[0:124:2] and per_rank[1] == epoch1[1:124:2]
    # Iterated as a dataset, each pass is the next epoch; resuming mid-epoch continues the same order.
    passes = TokenWindows(tokens, 2, 4, shuffle=True, seed=7)
    assert [x[:, 0].tolist() for x, _ in passes] == epoch0
    passes.load_state_dict(saved_at(passes, 1, 100))
    assert [x[:, 0].tolist() for x, _ in passes] == epoch1[100:]


def test_an_epoch_is_a_whole_number_of_optimizer_steps():
    """12 batches at 5 a step: 10 an epoch, so Lightning's end-of-epoch step is never short. A batch's
    place does not move with the accumulation (a position means the same batches under another)."""
    tokens = np.arange(101, dtype=np.uint16)  # 12 batches of 2 x 4
    for shuffle in (False, True):
        whole = [x[:, 0].tolist() for x, _ in TokenWindows(tokens, 2, 4, shuffle=shuffle, seed=7)]
        windows = TokenWindows(tokens, 2, 4, shuffle=shuffle, seed=7, accumulate=5)
        assert (len(windows), windows.available()) == (10, 12)
        assert [x[:, 0].tolist() for x, _ in windows] == whole[:10]
        assert windows.state_dict()["batches"] == 10
        windows.load_state_dict(saved_at(windows, 0, 7))
        assert [x[:, 0].tolist() for x, _ in windows] == whole[7:10]  # the resumed epoch ends where it should
    ranks = [TokenWindows(tokens, 2, 4, rank=r, world_size=2, accumulate=4) for r in (0, 1)]
    assert [len(w) for w in ranks] == [4, 4] and [len(list(w)) for w in ranks] == [4, 4]  # 6 each, 4 served


def test_data_module_reports_the_reference_numbers(cache_dir, capsys, caplog):
    dm = TokenStreamDataModule(batch_size=16, block_size=1024, val_fraction=0.0)
    dm.prepare_data()
    with caplog.at_level("INFO"):
        dm.setup("fit")
    text = caplog.text + capsys.readouterr().out
    assert "loaded 338025 tokens" in text
    assert "1 epoch = 20 batches" in text
    assert len(dm.train_dataloader()) == 20
    assert dm.val_dataloader() == []


def test_validation_split_is_the_held_out_tail(small_text, tmp_path):
    dm = TokenStreamDataModule(str(small_text), batch_size=2, block_size=16, val_fraction=0.25, cache_dir=str(tmp_path))
    dm.setup("fit")
    n = len(dm.tokens)
    assert dm.train_token_count == n - int(n * 0.25)
    x, _ = next(iter(dm.val_dataloader()))
    assert x[0, 0].item() == int(dm.tokens[dm.train_token_count])


def test_token_cache_is_reused_then_rebuilt_when_the_source_changes(small_text, tmp_path, monkeypatch):
    first = token_cache.build_token_cache(Corpus.from_file(small_text), tmp_path)
    assert first.stat().st_size == 2 * len(token_cache.load_tokens(first))

    def must_not_tokenize():
        raise AssertionError("a sound cache was tokenized again")

    monkeypatch.setattr(token_cache, "encode_items", must_not_tokenize)
    assert token_cache.build_token_cache(Corpus.from_file(small_text), tmp_path) == first
    monkeypatch.undo()

    small_text.write_text(small_text.read_text() + "\nA new line.\n")
    second = token_cache.build_token_cache(Corpus.from_file(small_text), tmp_path)
    assert second != first
    assert len(token_cache.load_tokens(second)) > len(token_cache.load_tokens(first))


def test_setup_reuses_the_cache_prepare_data_verified(small_text, tmp_path, monkeypatch):
    dm = TokenStreamDataModule(str(small_text), batch_size=2, block_size=16, cache_dir=str(tmp_path))
    dm.prepare_data()
    calls = []
    monkeypatch.setattr("gpt_lightning.data.datamodule.build_token_cache", lambda *a: calls.append(a))
    dm.setup("fit")
    assert calls == [] and len(dm.tokens) > 0


def test_a_launch_checks_a_settled_cache_by_size_and_mtime_without_reading_it(small_text, tmp_path, monkeypatch):
    """Each launch hashed the whole text and token file on every rank (8 full reads of a multi-GB
    corpus for 8 ranks); a file whose size and mtime are those it was hashed at is now only stat'ed."""
    hashed = []

    def counting(real):
        return lambda path: hashed.append(Path(path).suffix) or real(path)

    monkeypatch.setattr("gpt_lightning.data.corpus.sha256_file", counting(token_cache.sha256_file))
    monkeypatch.setattr("gpt_lightning.data.token_cache.sha256_file", counting(token_cache.sha256_file))

    def launch():  # as Lightning calls them: prepare_data on (local) rank 0, then setup on every rank
        ranks = [
            TokenStreamDataModule(str(small_text), batch_size=2, block_size=16, cache_dir=str(tmp_path))
            for _ in range(2)
        ]
        ranks[0].prepare_data()
        for dm in ranks:
            dm.setup("fit")
        hashes, tokens = sorted(hashed), [np.asarray(dm.tokens) for dm in ranks]
        hashed.clear()
        return hashes, tokens

    def age(path):  # the file was written a minute ago: its mtime has settled
        old = path.stat().st_mtime_ns - 60 * 10**9
        os.utime(path, ns=(old, old))

    launch()  # tokenizes
    (bin_path,) = (tmp_path / "tokens").glob("*.bin")
    age(small_text), age(bin_path)
    assert launch()[0] == [".bin", ".txt"]  # hashed once on rank 0, which stamps them; rank 1 trusts the stamps
    hashes, (tokens, _) = launch()
    assert hashes == []  # the launches after that read neither file

    age(small_text)  # touched (a new mtime), same text: hashed again, not tokenized again
    with monkeypatch.context() as m:
        m.setattr(token_cache, "encode_items", lambda *a, **k: pytest.fail("the same text was tokenized again"))
        assert launch()[0] == [".txt"] and launch()[0] == []

    text = small_text.read_text()
    small_text.write_text(text.replace("Citizen", "CITIZEN"))  # same size, new content and mtime
    assert small_text.stat().st_size == len(text.encode())
    hashes, (edited, edited_rank1) = launch()
    assert ".txt" in hashes and not np.array_equal(edited, tokens) and np.array_equal(edited, edited_rank1)


def test_data_shuffle_serves_the_training_split_in_a_seeded_order(small_text, tmp_path):
    def firsts(**kwargs):
        dm = TokenStreamDataModule(
            str(small_text), batch_size=2, block_size=16, val_fraction=0.1, cache_dir=str(tmp_path), **kwargs
        )
        dm.setup("fit")
        return [x[:, 0].tolist() for x, _ in dm.train_dataloader()], [x[:, 0].tolist() for x, _ in dm.val_dataloader()]

    (plain, val), (shuffled, shuffled_val) = firsts(), firsts(shuffle=True, seed=1)
    assert shuffled != plain and len(shuffled) == len(plain)
    assert shuffled == firsts(shuffle=True, seed=1)[0] and shuffled != firsts(shuffle=True, seed=2)[0]
    assert shuffled_val == val  # validation always reads the same batches
