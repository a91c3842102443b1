"""The streaming tokenizer: the ids of one-shot encoding however the text is cut, the same shard bytes
on 1 or 2 workers, every input kind and output format, and the FineWeb recipe trained on its shards."""

import gzip
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, tiny_flags

from gpt_lightning.cli import main
from gpt_lightning.data import token_cache
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.data.documents import safe_cut, text_pieces
from gpt_lightning.data.shard_writer import tokenize_to_shards
from gpt_lightning.data.shards import find_shards, open_shard
from gpt_lightning.data.tokenizer import gpt2_encoding

# Every kind of whitespace run the GPT-2 pattern treats specially, next to every kind of neighbour.
TRICKY = "a  \nb\r\nc \n d\n\ne\u3000\nf\tg\n'sx\n\u00a0y\nz\u2028\nw\n\n\n  \nq\x1c\nr\n1\n!\n\u00e9t\u00e9\n"


@pytest.mark.parametrize("chunk_chars", [1, 7, 4096])
def test_cut_pieces_encode_to_the_ids_of_the_whole_text(shakespeare, chunk_chars):
    enc = gpt2_encoding()
    for text in (TRICKY * 3, shakespeare[:40_000] if chunk_chars < 4096 else shakespeare):
        pieces = [p for _, p in text_pieces(io.StringIO(text, newline=""), chunk_chars, False)]
        assert "".join(pieces) == text and (len(pieces) > 10 or len(text) < 10 * chunk_chars)
        assert [t for p in pieces for t in enc.encode_ordinary(p)] == enc.encode_ordinary(text)


def test_safe_cuts_are_only_after_a_lone_newline_between_non_spaces():
    assert safe_cut("ab\ncd") == 3 and safe_cut("ab\r\ncd") == 3  # x\n|c and x\r|\nc
    assert safe_cut("ab \ncd") == 0 and safe_cut("ab\n cd") == 0 and safe_cut("ab\n\ncd") == 0


def test_the_token_cache_streams_on_two_workers_to_the_one_shot_ids(shakespeare, tmp_path):
    path = tmp_path / "shakespeare.txt"
    path.write_bytes(shakespeare.encode())
    cache = token_cache.build_token_cache(Corpus.from_file(path), tmp_path / "cache", workers=2, chunk_chars=50_000)
    ids = token_cache.load_tokens(cache)
    assert len(ids) == 338_025
    assert ids.tolist() == gpt2_encoding().encode_ordinary(shakespeare)


def write_inputs(folder, shakespeare):
    """The same 30 documents as .txt, .jsonl, .jsonl.gz and FineWeb-edu-style .parquet."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    docs = [shakespeare[i * 3000 : (i + 1) * 3000] for i in range(30)]
    folder.mkdir()
    for i, doc in enumerate(docs[:5]):
        (folder / f"a{i}.txt").write_text(doc)
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs[5:15]))
    (folder / "b.jsonl").write_text(lines)
    (folder / "c.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[15:20]).encode())
    )
    table = pa.table({"text": docs[20:], "id": [f"<urn:{i}>" for i in range(10)], "score": [3.1] * 10})
    pq.write_table(table, folder / "d.parquet", row_group_size=4)
    return docs


def test_encoding_workers_die_on_sigterm_whatever_handler_the_parent_holds():
    """After a Lightning fit a process can hold a SIGTERM handler that only notes the signal (the
    trainer's graceful stop). Forked encoders inherited it, so Pool.terminate, which stops its idle
    workers with SIGTERM, could wait on one forever: tokenize hung under pytest-xdist. Each worker
    reports its SIGTERM handler (a subprocess, so that a hang is a timeout)."""
    code = (
        "import signal\n"
        "import numpy as np\n"
        "import gpt_lightning.data.encode as encode\n"
        "from gpt_lightning.data.documents import WorkItem\n"
        "signal.signal(signal.SIGTERM, lambda *_: None)\n"
        "def report(item):\n"
        "    return np.array([signal.getsignal(signal.SIGTERM) is signal.SIG_DFL])\n"
        "encode.encode_item = report\n"
        "print(sorted({bool(ids[0]) for _, ids in encode.encode_items([WorkItem(position=i) for i in range(8)], workers=2)}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[True]"


def test_every_input_kind_and_the_same_bytes_on_one_or_two_workers(shakespeare, tmp_path):
    docs = write_inputs(tmp_path / "in", shakespeare)
    enc = gpt2_encoding()
    expected = [t for d in docs for t in [enc.eot_token, *enc.encode_ordinary(d)]]
    outputs = {}
    for workers in (1, 2):
        written = tokenize_to_shards(
            str(tmp_path / "in"),
            tmp_path / f"w{workers}",
            shard_tokens=5000,
            workers=workers,
            progress=False,
            chunk_chars=2000,
        )
        outputs[workers] = [p.read_bytes() for p, _ in written]
        assert np.concatenate([np.load(p) for p, _ in written]).tolist() == expected
    assert outputs[1] == outputs[2] and len(outputs[1]) > 3
    manifest = json.loads((tmp_path / "w2" / "tokenize.json").read_text())
    assert manifest["tokens"] == len(expected) and manifest["shards"][0] == {
        "file": "shard_val_000000.npy",
        "tokens": 5000,
    }


@pytest.mark.parametrize("format", ["npy", "llmc", "ours"])
def test_every_format_reads_back_through_the_data_module(shakespeare, tmp_path, format):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(shakespeare[:30_000])
    written = tokenize_to_shards(
        str(tmp_path / "in" / "*.txt"), tmp_path / "out", shard_tokens=2000, format=format, workers=1, progress=False
    )
    enc = gpt2_encoding()
    expected = [enc.eot_token, *enc.encode_ordinary(shakespeare[:30_000])]
    assert np.concatenate([open_shard(p) for p, _ in written]).tolist() == expected
    data = TokenStreamDataModule(str(tmp_path / "out"), batch_size=2, block_size=16)
    data.setup("fit")
    assert next(iter(data.train_dataloader()))[0][0, 0].item() == expected[2000]


def test_bad_inputs_are_one_clear_line(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"content": "no text field"}\n')
    for args, words in [
        (["--input", str(tmp_path / "nowhere")], "does not exist"),
        (["--input", str(tmp_path / "in")], "'text' string"),
        (["--input", str(tmp_path / "in"), "--text_key", "content", "--shard_tokens", "100000"], "nothing was written"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["tokenize", *args, "--output", str(tmp_path / "out"), "--workers", "1"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and "Traceback" not in err
    assert not list((tmp_path / "out").glob("*.npy"))  # nothing half-written left behind


def test_a_fineweb_edu_style_parquet_folder_trains_the_fineweb_recipe(shakespeare, tmp_path, capsys):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "fineweb-edu" / "sample" / "10BT"
    folder.mkdir(parents=True)
    for f in range(2):  # FineWeb-edu's columns; the text is what is read
        texts = [shakespeare[(f * 20 + i) * 1500 : (f * 20 + i + 1) * 1500] for i in range(20)]
        pq.write_table(
            pa.table(
                {
                    "text": texts,
                    "id": [str(i) for i in range(20)],
                    "dump": ["CC-MAIN"] * 20,
                    "url": ["u"] * 20,
                    "language": ["en"] * 20,
                    "score": [3.0] * 20,
                    "int_score": [3] * 20,
                    "token_count": [0] * 20,
                }
            ),
            folder / f"{f:03d}_00000.parquet",
        )
    main(
        [
            "tokenize",
            "--input",
            str(folder),
            "--output",
            str(tmp_path / "edu_fineweb10B"),
            "--shard_tokens",
            "4000",
            "--workers",
            "2",
        ]
    )
    assert len(find_shards(tmp_path / "edu_fineweb10B")["train"]) >= 3
    progress = capsys.readouterr().err
    assert "tokenizing: 100.0%" in progress and "M tokens/s, ETA" in progress
    # At the recipe's own bf16-mixed with its clipping at 1.0.
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "gpt2-124m-fineweb.yaml"),
            *tiny_flags(
                {
                    "trainer.accelerator": "cpu",
                    "data.data_path": tmp_path / "edu_fineweb10B",
                    "data.tokens_per_step": 64,
                    "trainer.max_steps": 3,
                    "model.warmup_steps": 1,
                    "model.cosine_decay_steps": 2,
                    "trainer.val_check_interval": 3,
                    "trainer.limit_val_batches": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    (run,) = (tmp_path / "tb" / "gpt2-124m-fineweb").iterdir()
    assert (run / "checkpoints" / "last.ckpt").is_file()


POOL_STOPPED_AT_ONCE = """
import signal, time
from gpt_lightning.data import encode
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # records and returns, as Lightning's left behind by a fit
start = encode._default_sigterm
encode._default_sigterm = lambda: (time.sleep(1), start())  # a worker still starting when the pool is stopped


def items():
    raise RuntimeError("the input ends the run at once")
    yield


try:
    list(encode.encode_items(items(), 2))
except RuntimeError as err:
    print(err)
"""


def test_a_pool_stopped_while_its_workers_start_ends_whatever_sigterm_handler_they_inherit():
    """``Pool.terminate`` SIGTERMs workers that may not have run their initializer yet: they must still die."""
    done = subprocess.run(
        [sys.executable, "-c", POOL_STOPPED_AT_ONCE], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip()) == (0, "the input ends the run at once"), done.stderr[-2000:]
