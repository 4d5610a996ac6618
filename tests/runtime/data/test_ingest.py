"""runtime.data.files: each format parsed from lines written in it, the schema's transforms, sharding
(every row read exactly once across reader counts), the shuffle buffer and sharded training.

References are independent of the code under test: FNV-1a written out byte by byte in Python here
(checked against the published test vector), numpy for the transforms, the rows as written.
"""

from __future__ import annotations

import gzip
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime.data import open_dataset
from runtime.data.files import Schema
from runtime.data.files.dataset import prefetched


def fnv1a_64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def ref_id(column: str, value: str, vocab: int) -> int:
    return 1 + fnv1a_64(f"{column}\x1f{value}".encode()) % (vocab - 1)


def test_reference_hash_is_fnv1a():
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C  # the FNV authors' test vector
    assert fnv1a_64(b"foobar") == 0x85944171F73967E8


def test_stable_hash_of_every_kind_of_string_column_is_fnv1a_by_hand():
    """The compiled hash (`hash_ids`) against the byte-by-byte reference: nulls (as ""), empty
    and long values, UTF-8, a slice whose validity bits start mid-byte, large_string, dictionary
    and numeric columns, and ids written into a strided column of a wider array."""
    from runtime.data.files.schema import hash_ids

    values = ["", None, "0a1b2c3d", "x" * 37, "é€😀", None, "k", "68fd1e64", None, "z" * 9, "", "q"]

    def want(vals: list, col: str, vocab: int = 997, first: int = 1) -> list[int]:
        return [first + fnv1a_64(f"{col}\x1f{v or ''}".encode()) % (vocab - first) for v in vals]

    arr = pa.array(values, pa.string())
    for col, vals in [
        (arr, values),
        (arr.slice(3), values[3:]),  # validity bitmap read from bit 3
        (arr.slice(5, 4), values[5:9]),
        (pa.array(values, pa.large_string()).slice(1), values[1:]),
        (arr.dictionary_encode(), values),
        (pa.chunked_array([arr.slice(0, 5), arr.slice(5)]), values),
    ]:
        np.testing.assert_array_equal(hash_ids(col, "C7", 997), want(vals, "C7"), err_msg=str(col.type))
    np.testing.assert_array_equal(hash_ids(arr, "C7", 50, first=9), want(values, "C7", 50, 9))
    ints = pa.array([7, None, -12, 0], pa.int64())
    np.testing.assert_array_equal(hash_ids(ints, "n", 997), want(["7", None, "-12", "0"], "n"))
    wide = np.full((len(values), 3), -1, np.int64)
    hash_ids(arr, "C7", 997, out=wide[:, 1])
    np.testing.assert_array_equal(wide[:, 1], want(values, "C7"))
    assert (wide[:, [0, 2]] == -1).all()
    assert hash_ids(pa.array([], pa.string()), "C7", 997).shape == (0,)
    with pytest.raises(ValueError, match="writes 12 int64 ids; `out` is int64 \\(3,\\)"):
        hash_ids(arr, "C7", 997, out=wide[0])  # a row, not a column: refused, nothing written past it


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ints = [str(v) if v > -5 else "" for v in rng.integers(-6, 100, 13)]
        cats = [f"{x:08x}" if x % 7 else "" for x in rng.integers(0, 50, 26)]
        out.append("\t".join([str(i % 2), *ints, *cats]))
    return out


CRITEO = {
    "label": "label",
    "dense": [f"I{i}" for i in range(1, 14)],
    "transform": "log1p",
    "sparse": [f"C{i}" for i in range(1, 27)],
    "vocab": 1000,
}


def criteo_reference(lines: list[str], vocab: int = 1000) -> dict[str, np.ndarray]:
    f = [line.split("\t") for line in lines]
    dense = np.array([[float(x) if x else 0.0 for x in r[1:14]] for r in f])
    return {
        "label": np.array([[float(r[0])] for r in f], np.float32),
        "dense": np.log1p(np.maximum(dense, 0)).astype(np.float32),
        "sparse": np.array([[ref_id(f"C{j + 1}", x, vocab) for j, x in enumerate(r[14:])] for r in f]),
    }


def concat(batches: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def assert_feeds(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("gz", [False, True])
def test_criteo_tsv_plain_and_gz(tmp_path, gz):
    lines = criteo_lines(50)
    text = ("\n".join(lines) + "\n").encode()
    path = tmp_path / ("day_0.txt.gz" if gz else "day_0.txt")
    path.write_bytes(gzip.compress(text) if gz else text)
    ds = open_dataset(path, CRITEO, batch_size=16)
    assert ds.format == "criteo"
    batches = list(ds)
    assert [len(b["label"]) for b in batches] == [16, 16, 16, 2]
    assert_feeds(concat(batches), criteo_reference(lines))


@pytest.mark.parametrize("block", [7, 100, 4096])
@pytest.mark.parametrize("gz", [False, True])
def test_lines_cut_by_the_read_blocks_anywhere_are_read_whole_once(tmp_path, monkeypatch, block, gz):
    """Reads of `block` bytes (shorter than a line, or cutting lines anywhere), the last line
    without a newline, and byte-range shards: the rows as written, each once, in order."""
    from runtime.data.files import formats

    monkeypatch.setattr(formats, "BLOCK", block)
    lines = criteo_lines(40)
    text = "\n".join(lines).encode()
    path = tmp_path / ("day_0.txt.gz" if gz else "day_0.txt")
    path.write_bytes(gzip.compress(text) if gz else text)
    ds = open_dataset(path, CRITEO, batch_size=16)
    want = criteo_reference(lines)
    assert_feeds(concat(list(ds)), want)
    for readers in (2, 3):  # reader i's rows come after reader i - 1's in the file
        assert_feeds(concat([feed for i in range(readers) for feed, _ in ds.shard(i, readers)]), want)


@pytest.mark.parametrize("block", [5, 4096])
def test_a_shard_boundary_at_a_line_start_gives_that_line_to_the_next_reader(tmp_path, monkeypatch, block):
    from runtime.data.files import formats

    monkeypatch.setattr(formats, "BLOCK", block)
    path = tmp_path / "rows.csv"  # 40 lines of 14 bytes: 2, 4, 5 and 8 readers split at line starts
    path.write_text("row,click,pad\n" + "".join(f"{i:03d},{i % 2},xxxxxxx\n" for i in range(39)))
    ds = open_dataset(path, {"label": "click", "dense": ["row"], "vocab": 10}, batch_size=8)
    for readers in (2, 4, 5, 8):
        got = [feed["dense"][:, 0] for i in range(readers) for feed, _ in ds.shard(i, readers)]
        np.testing.assert_array_equal(np.concatenate(got), np.arange(39), err_msg=str(readers))


def test_slot_text_format(tmp_path):
    lines = [
        "click:0 dense_feature:0.05 dense_feature:0.5 1:737395 2:210498 3:5",
        "click:1 dense_feature:1 dense_feature:2 1:7 3:9 2:11 3:12",  # slot 3 twice, out of order
        "click:0 dense_feature:0 dense_feature:-1 1:8",
    ]  # slots 2 and 3 missing
    path = tmp_path / "part-0.txt"
    path.write_text("\n".join(lines) + "\n")
    schema = {
        "label": "click",
        "dense": ["dense_feature"],
        "sparse": ["1", "2"],
        "multi": {"3": " "},
        "max_len": 3,
        "vocab": 100,
    }
    (b,) = list(open_dataset(path, schema, batch_size=8))
    np.testing.assert_array_equal(b["label"].ravel(), [0, 1, 0])
    np.testing.assert_allclose(b["dense"], [[0.05, 0.5], [1, 2], [0, -1]], rtol=1e-6)
    want = [
        [ref_id("1", v, 100) for v in ("737395", "7", "8")],
        [ref_id("2", v, 100) for v in ("210498", "11", "")],
    ]
    np.testing.assert_array_equal(b["sparse"], np.array(want).T)
    bag3 = [[ref_id("3", "5", 100), 0, 0], [ref_id("3", "9", 100), ref_id("3", "12", 100), 0], [0, 0, 0]]
    np.testing.assert_array_equal(b["3"], bag3)
    np.testing.assert_array_equal(b["3_len"].ravel(), [1, 2, 0])


MOVIES = (
    "user_id,item_id,rating,age,gender,genres\n"
    + "\n".join(
        [
            "1,10,5,25,M,Comedy|Drama",
            "2,11,3,,F,Action",
            "3,10,4,40,,Comedy|Drama|Romance|War",
            "4,12,1,18,M,",
        ]
    )
    + "\n"
)


def movie_schema(**kw) -> dict:
    return {
        "label": "rating",
        "label_threshold": 4,
        "dense": ["age"],
        "sparse": ["user_id", "item_id", "gender"],
        "multi": {"genres": "|"},
        "max_len": 3,
        "vocab": 50,
        **kw,
    }


@pytest.mark.parametrize("sep", [",", "\t"])
def test_csv_and_tsv_with_header_and_schema_transforms(tmp_path, sep):
    path = tmp_path / ("ratings.csv" if sep == "," else "ratings.tsv")
    path.write_text(MOVIES.replace(",", sep))
    (b,) = list(open_dataset(path, movie_schema(transform="standardize"), batch_size=10))
    np.testing.assert_array_equal(b["label"].ravel(), [1, 0, 1, 0])  # rating >= 4
    age = np.array([25, 0, 40, 18.0])  # a missing value is 0
    np.testing.assert_allclose(b["dense"].ravel(), (age - age.mean()) / age.std(), rtol=1e-5)
    rows = [r.split(",") for r in MOVIES.splitlines()[1:]]
    want = [[ref_id(c, r[k], 50) for c, k in (("user_id", 0), ("item_id", 1), ("gender", 4))] for r in rows]
    np.testing.assert_array_equal(b["sparse"], want)
    g = [[ref_id("genres", x, 50) for x in r[5].split("|") if x][:3] for r in rows]
    np.testing.assert_array_equal(b["genres"], [x + [0] * (3 - len(x)) for x in g])  # cut at max_len, pad 0
    np.testing.assert_array_equal(b["genres_len"].ravel(), [2, 1, 3, 0])
    assert b["sparse"].dtype == np.int64 and b["dense"].dtype == np.float32 and b["genres"].dtype == np.int64


def test_categoricals_in_another_encoding_hash_their_bytes(tmp_path):
    path = tmp_path / "latin1.csv"  # "Café", "Noël" in Latin-1: not UTF-8
    path.write_bytes("user_id,item_id,rating,age,gender,genres\n1,Café,5,25,M,Noël|Drama\n".encode("latin-1"))
    (b,) = list(open_dataset(path, movie_schema(), batch_size=4))
    ref = lambda col, value: 1 + fnv1a_64(col.encode() + b"\x1f" + value.encode("latin-1")) % 49
    np.testing.assert_array_equal(
        b["sparse"], [[ref("user_id", "1"), ref("item_id", "Café"), ref("gender", "M")]]
    )
    np.testing.assert_array_equal(b["genres"], [[ref("genres", "Noël"), ref("genres", "Drama"), 0]])


def test_log1p_and_stats_given_in_the_schema(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text(MOVIES)
    (b,) = list(open_dataset(path, movie_schema(transform="log1p"), batch_size=10))
    np.testing.assert_allclose(b["dense"].ravel(), np.log1p([25, 0, 40, 18]), rtol=1e-6)
    s = movie_schema(transform={"age": "standardize"}, stats={"age": [20.0, 10.0]})
    (b,) = list(open_dataset(path, s, batch_size=10))
    np.testing.assert_allclose(b["dense"].ravel(), (np.array([25, 0, 40, 18]) - 20) / 10, rtol=1e-6)


def write_parquet(tmp_path, n: int, files: int, group: int) -> list[int]:
    ids = list(range(n))
    (tmp_path / "pq").mkdir()
    for k in range(files):
        part = ids[k::files]
        t = pa.table(
            {
                "row": part,
                "click": [i % 3 == 0 for i in part],
                "cat": [f"c{i % 5}" for i in part],
                "tags": [[f"t{i % 4}", f"t{i % 6}"] for i in part],
            }
        )
        pq.write_table(t, tmp_path / "pq" / f"part-{k}.parquet", row_group_size=group)
    return ids


def test_parquet_files_directories_globs_and_list_columns(tmp_path):
    write_parquet(tmp_path, 30, 2, 4)
    schema = {"label": "click", "dense": ["row"], "sparse": ["cat"], "multi": {"tags": ","}, "vocab": 10}
    for spec in (
        tmp_path / "pq",
        str(tmp_path / "pq" / "*.parquet"),
        [tmp_path / "pq" / "part-0.parquet", tmp_path / "pq" / "part-1.parquet"],
    ):
        b = concat(list(open_dataset(spec, schema, batch_size=7)))
        rows = b["dense"].ravel().astype(int)
        assert rows.tolist() == list(range(0, 30, 2)) + list(range(1, 30, 2))
        np.testing.assert_array_equal(b["label"].ravel(), rows % 3 == 0)
        np.testing.assert_array_equal(b["sparse"].ravel(), [ref_id("cat", f"c{i % 5}", 10) for i in rows])
        np.testing.assert_array_equal(
            b["tags"][:, :2],
            [[ref_id("tags", f"t{i % 4}", 10), ref_id("tags", f"t{i % 6}", 10)] for i in rows],
        )


def test_bad_input_is_refused_clearly(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text(MOVIES)
    with pytest.raises(ValueError, match="columns \\['zip'\\] that .*r.csv lacks"):
        open_dataset(path, {"label": "rating", "sparse": ["zip"]}, batch_size=4)
    with pytest.raises(ValueError, match="unknown keys.*'sparce'"):
        open_dataset(path, {"label": "rating", "sparce": ["zip"]}, batch_size=4)
    with pytest.raises(ValueError, match="transform"):
        Schema.load({"label": "rating", "dense": ["age"], "transform": "sqrt"})
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        open_dataset(tmp_path / "nothing-here.csv", {"label": "rating", "dense": ["age"]}, batch_size=4)
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,x\n")
    with pytest.raises(ValueError, match="bad.csv"):
        list(open_dataset(bad, {"label": "a", "dense": ["b"]}, batch_size=4))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n".join(criteo_lines(3)[:2] + ["", criteo_lines(3)[2]]) + "\n")
    with pytest.raises(ValueError, match="blank.txt"):
        list(open_dataset(blank, CRITEO, batch_size=4))


def shard_rows(ds, readers: int) -> list[list[tuple[np.ndarray, int]]]:
    return [[(f["dense"][:, 0].astype(int), g) for f, g in ds.shard(i, readers)] for i in range(readers)]


@pytest.mark.parametrize("kind", ["csv", "gz", "parquet"])
def test_sharding_reads_every_row_exactly_once_for_any_reader_count(tmp_path, kind):
    n, batch = 103, 8
    if kind == "parquet":
        write_parquet(tmp_path, n, 3, 5)
        paths, schema = tmp_path / "pq", {"label": "click", "dense": ["row"], "vocab": 10}
    else:  # 3 files of different lengths, ids of varying width so byte ranges cut lines anywhere
        paths = []
        for k, part in enumerate((range(0, 10), range(10, 70), range(70, n))):
            text = "row,click,pad\n" + "".join(f"{i},{i % 2},{'x' * (i * 7 % 23)}\n" for i in part)
            p = tmp_path / f"part-{k}.csv{'.gz' if kind == 'gz' else ''}"
            p.write_bytes(gzip.compress(text.encode()) if kind == "gz" else text.encode())
            paths.append(p)
        schema = {"label": "click", "dense": ["row"], "vocab": 10}
    ds = open_dataset(paths, schema, batch_size=batch)
    everything = np.concatenate([b["dense"][:, 0] for b in ds]).astype(int)
    assert len(everything) == n and len(set(everything.tolist())) == n
    for readers in (1, 2, 3, 5):
        got = shard_rows(ds, readers)
        seen = np.concatenate([r for reader in got for r, _ in reader])
        assert sorted(seen.tolist()) == sorted(everything.tolist()), readers  # none lost, none twice
        steps = {len(reader) for reader in got}
        assert len(steps) == 1, f"{readers} readers disagree on the steps of an epoch: {steps}"
        for t in range(steps.pop()):  # each step's global size is the rows the readers brought
            sizes = [len(reader[t][0]) for reader in got]
            assert {reader[t][1] for reader in got} == {sum(sizes)}
            assert all(s <= math.ceil(batch / readers) for s in sizes)
        if kind == "csv" and readers > 1:  # byte ranges: each reader reads a contiguous run of rows
            for reader in got:
                rows = np.concatenate([r for r, _ in reader]).tolist() if reader else []
                pos = [everything.tolist().index(r) for r in rows]
                assert pos == list(range(pos[0], pos[0] + len(pos))) if pos else True


def test_one_reader_iterates_the_files_in_order(tmp_path):
    lines = criteo_lines(40)
    for k in range(2):
        (tmp_path / f"day_{k}.txt").write_text("\n".join(lines[20 * k : 20 * k + 20]))  # no final newline
    ds = open_dataset(sorted(tmp_path.glob("day_*.txt")), CRITEO, batch_size=6)
    assert_feeds(concat(list(ds)), criteo_reference(lines))
    assert [g for _, g in ds.shard(0, 1)] == [6] * 6 + [4]


def test_shuffle_buffer_is_seeded_and_loses_nothing(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("row,click\n" + "".join(f"{i},{i % 2}\n" for i in range(200)))
    schema = {"label": "click", "dense": ["row"], "vocab": 10}

    def order(seed: int, shuffle: int = 64) -> list[int]:
        ds = open_dataset(path, schema, batch_size=10, shuffle=shuffle, seed=seed)
        return [int(x) for b in ds for x in b["dense"][:, 0]]

    a, b, c = order(1), order(1), order(2)
    assert a == b and a != c and sorted(a) == list(range(200)) and a != list(range(200))
    assert order(1, shuffle=0) == list(range(200))
    ds = open_dataset(path, schema, batch_size=10, shuffle=64, seed=1)
    first, second = ([int(x) for b in ds for x in b["dense"][:, 0]] for _ in range(2))
    assert first != second and sorted(first) == sorted(second)  # a new permutation every epoch


@pytest.mark.parametrize("block", [64, 4096])
def test_shuffle_permutes_windows_of_its_rows_whatever_the_read_blocks(tmp_path, monkeypatch, block):
    from runtime.data.files import formats

    monkeypatch.setattr(formats, "BLOCK", block)
    path = tmp_path / "r.csv"
    path.write_text("row,click\n" + "".join(f"{i},{i % 2}\n" for i in range(200)))
    ds = open_dataset(path, {"label": "click", "dense": ["row"]}, batch_size=10, shuffle=64, seed=1)
    got = [int(x) for b in ds for x in b["dense"][:, 0]]
    for lo, hi in ((0, 70), (70, 140), (140, 200)):  # 64 rows rounded up to 7 batches of 10
        assert sorted(got[lo:hi]) == list(range(lo, hi)) and got[lo:hi] != list(range(lo, hi))
    rng = np.random.default_rng((1, 0, 0))  # the seed of (seed, epoch, reader)
    want = [lo + i for lo, hi in ((0, 70), (70, 140), (140, 200)) for i in rng.permutation(hi - lo)]
    assert got == want


def test_prefetch_thread_passes_errors_and_stops_when_closed():
    def boom():
        yield 1
        raise ValueError("parse failed at line 7")

    it = prefetched(boom, 2)
    assert next(it) == 1
    with pytest.raises(ValueError, match="line 7"):
        next(it)
    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    it = prefetched(endless, 2)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    n = len(produced)
    import time

    time.sleep(0.3)
    assert len(produced) == n <= 6  # the thread stopped, a few items ahead at most


def test_two_readers_train_on_their_shards_as_one_process_on_the_joined_batches(tmp_path):
    """Sync training with 2 reader trainers, each reading only its half of the file, equals
    single-process training on global batches made of the two readers' local batches; the halves
    differ in rows, so the last step has rows from one reader only."""
    from procs import alive
    from test_runtime_train import assert_same_params, single_process

    from runtime import train
    from runtime.engines import LocalEngine
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    rng = np.random.default_rng(0)
    lines = [
        f"{rng.integers(0, 2)},{rng.normal():.4f},u{rng.integers(0, 30)},i{rng.integers(0, 9)},"
        f"{'long-' * (i < 40)}g{rng.integers(0, 3)}"
        for i in range(75)
    ]
    path = tmp_path / "clicks.csv"
    path.write_text("click,x,user,item,group\n" + "\n".join(lines) + "\n")
    schema = {"label": "click", "dense": ["x"], "sparse": ["user", "item", "group"], "vocab": 64}
    ds = open_dataset(path, schema, batch_size=16)
    shards = [list(ds.shard(i, 2)) for i in range(2)]
    assert len(shards[0]) == len(shards[1]) and len(shards[0][-1][0]["label"]) == 0  # reader 0 is done first
    joined = [concat([a, b]) for (a, _), (b, _) in zip(*shards, strict=True)]
    model = wide_deep(num_slots=3, num_dense=1, vocab=64, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.5))
    eng = LocalEngine()
    hist = train(
        model.main,
        ds,
        epochs=2,
        trainers={"cpu": 2, "gpu": 1},
        micro_batches=2,
        engine=eng,
        allow_emulation=True,
        return_params=True,
        progress=False,
    )
    want = single_process(model, joined + joined)
    assert hist.examples == [len(b["label"]) for b in joined] * 2 and sum(hist.examples) == 150
    assert_same_params(hist.params, want, [t.name for t in transpile(model.main).tables])
    assert not alive(eng.pids().values())


def test_cli_trains_a_plan_on_parquet_by_schema_and_refuses_bad_combinations(tmp_path, capsys):
    from runtime.cli.app import main
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    write_parquet(tmp_path, 64, 2, 8)
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: click\ndense: [row]\ntransform: standardize\nsparse: [cat]\nvocab: 16\n")
    plan = tmp_path / "plan"
    transpile(
        wide_deep(num_slots=1, num_dense=1, vocab=16, dim=4, hidden=(8,), optimizer=nn.SGD(0.1)).main
    ).save(plan)
    data = str(tmp_path / "pq" / "*.parquet")
    common = ["--data", data, "--schema", schema, "--batch-size", "16", "--allow-emulation", "--no-progress"]
    assert main(["train", str(plan), *map(str, common), "--epochs", "2"]) == 0
    assert capsys.readouterr().out.startswith("8 steps")  # 2 epochs of 64 rows in global batches of 16
    # a plan evaluates held-out files read by the same schema (issue 15: --eval-data beyond --model)
    assert main(["train", str(plan), *map(str, common), "--epochs", "1", "--eval-data", data]) == 0
    assert "held-out at step 4: loss" in capsys.readouterr().out
    for argv, message in (
        ([*common, "--epochs", "1"], "give a PLAN_DIR"),
        ([plan, *common, "--model", "dlrm", "--epochs", "1"], "give a PLAN_DIR"),
        (["--data", data, "--model", "dlrm", "--epochs", "1"], "add --schema"),
        ([plan, *common, "--eval-every", "2", "--epochs", "1"], "--eval-every N needs --eval-data"),
        (
            ["--data", str(tmp_path / "none.csv"), "--schema", schema, "--model", "dlrm", "--epochs", "1"],
            "none.csv",
        ),
    ):
        assert main(["train", *map(str, argv)]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_file_larger_than_the_memory_limit_streams(tmp_path):
    """A 2.5 GiB CSV read under a 2.2 GiB address-space limit (the baseline of a Python process
    with numpy, pyarrow and numba is ~1.6 GiB of address space): every row arrives, its categorical
    hashed, and reading the file whole under the same limit fails, so the limit binds."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "big.csv"
    rows_per_block, blocks = 2000, 1360
    line = "{i},1,{c},{pad}\n"
    block = "".join(line.format(i=i % 7, c=i % 5, pad="x" * 1000) for i in range(rows_per_block)).encode()
    with open(path, "wb") as f:
        f.write(b"x,click,c,pad\n")
        for _ in range(blocks):
            f.write(block)
    assert path.stat().st_size > 2.5 * 2**30 > 2.2 * 2**30
    limit = int(2.2 * 2**30)
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
        "from runtime.data import open_dataset\n"
        "if sys.argv[1] == 'whole':\n"
        "    data = open(sys.argv[2], 'rb').read()\n"
        "else:\n"
        "    schema = {'label': 'click', 'dense': ['x'], 'sparse': ['c'], 'vocab': 1000}\n"
        "    ds = open_dataset(sys.argv[2], schema, batch_size=65536)\n"
        "    n = s = ids = 0\n"
        "    for b in ds:\n"
        "        n += len(b['label']); s += float(b['dense'].sum()); ids += int(b['sparse'].sum())\n"
        "    print(n, s, ids)\n"
    )
    root = str(Path(__file__).resolve().parents[3])
    run = lambda how: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, how, str(path)], capture_output=True, text=True, timeout=900, cwd=root
    )
    try:
        whole, streamed = run("whole"), run("stream")
    finally:
        path.unlink()  # 2.5 GiB: not left for pytest's kept temporary directories
    assert whole.returncode != 0 and "MemoryError" in whole.stderr
    assert streamed.returncode == 0, streamed.stderr
    n, s, ids = streamed.stdout.split()
    assert int(n) == rows_per_block * blocks
    assert float(s) == sum(i % 7 for i in range(rows_per_block)) * blocks
    assert int(ids) == sum(ref_id("c", str(i % 5), 1000) for i in range(rows_per_block)) * blocks


def test_a_bad_row_in_a_readers_shard_fails_the_run_naming_the_file(tmp_path):
    from procs import alive

    from runtime import TrainingError, train
    from runtime.engines import LocalEngine
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    rows = [f"{i % 2},{i},u{i % 7},{'p' * 40}" for i in range(4000)]  # 200 KB
    rows[3000] = "1,not-a-number,u3,p"  # in the second reader's half, past the first 64 KiB
    path = tmp_path / "clicks.csv"
    path.write_text("click,x,user,pad\n" + "\n".join(rows) + "\n")
    ds = open_dataset(
        path, {"label": "click", "dense": ["x"], "sparse": ["user"], "vocab": 32}, batch_size=16
    )
    model = wide_deep(num_slots=1, num_dense=1, vocab=32, dim=4, hidden=(4,), optimizer=nn.SGD(lr=0.1))
    eng = LocalEngine()
    with pytest.raises(TrainingError, match="clicks.csv: cannot read it as csv.*not-a-number") as err:
        train(
            model.main,
            ds,
            epochs=1,
            trainers={"cpu": 2, "gpu": 1},
            engine=eng,
            allow_emulation=True,
            progress=False,
        )
    assert err.value.who == "cpu:1"
    assert not alive(eng.pids().values())


def test_files_with_different_headers_are_refused(tmp_path):
    (tmp_path / "a.csv").write_text("click,x\n1,2\n")
    (tmp_path / "b.csv").write_text("click,y\n1,2\n")
    with pytest.raises(ValueError, match="b.csv has the columns \\['click', 'y'\\].*same header"):
        open_dataset(tmp_path, {"label": "click", "dense": ["x"]}, batch_size=2)


def test_vocab_files_give_listed_values_their_own_ids_and_hash_the_rest(tmp_path):
    (tmp_path / "items.txt").write_text("10\n11\n")
    (tmp_path / "genres.txt").write_text("Drama\nComedy\nAction\n")
    (tmp_path / "ratings.csv").write_text(MOVIES)
    (tmp_path / "schema.yaml").write_text(
        "label: rating\nlabel_threshold: 4\nsparse: [user_id, item_id]\nmulti: {genres: '|'}\nmax_len: 4\n"
        "vocab: 40\nvocab_files: {item_id: items.txt, genres: genres.txt}\n"
    )
    (b,) = list(open_dataset(tmp_path / "ratings.csv", tmp_path / "schema.yaml", batch_size=8))

    # K = 5 listed values: item ids 1, 2; genres 3, 4, 5 (in file order); others hash into [6, 40)
    def hashed(column: str, value: str) -> int:
        return 6 + fnv1a_64(f"{column}\x1f{value}".encode()) % 34

    np.testing.assert_array_equal(b["sparse"][:, 0], [hashed("user_id", u) for u in "1234"])
    np.testing.assert_array_equal(b["sparse"][:, 1], [1, 2, 1, hashed("item_id", "12")])
    np.testing.assert_array_equal(
        b["genres"],
        [
            [4, 3, 0, 0],
            [5, 0, 0, 0],
            [4, 3, hashed("genres", "Romance"), hashed("genres", "War")],
            [0, 0, 0, 0],
        ],
    )
    with pytest.raises(ValueError, match="vocab 6 must exceed the 5 values"):
        Schema.load(
            {
                "label": "rating",
                "sparse": ["item_id"],
                "multi": {"genres": "|"},
                "vocab": 6,
                "vocab_files": {
                    "item_id": str(tmp_path / "items.txt"),
                    "genres": str(tmp_path / "genres.txt"),
                },
            }
        )
    with pytest.raises(FileNotFoundError, match="no vocab file for 'item_id'"):
        Schema.load({"label": "rating", "sparse": ["item_id"], "vocab_files": {"item_id": "missing.txt"}})


def test_train_refuses_a_dataset_whose_feeds_do_not_fit_the_program(tmp_path):
    from runtime import train
    from transpiler import builder as nn
    from transpiler.models import dlrm, wide_deep

    path = tmp_path / "r.csv"
    path.write_text(MOVIES)
    ds = open_dataset(path, movie_schema(), batch_size=2)  # sparse [n, 3], dense [n, 1], genres bags
    with pytest.raises(ValueError, match=r"feed 'sparse'.*\[-1, 26\].* gives \[n, 3\]"):
        train(wide_deep(optimizer=nn.SGD(0.1)).main, ds, epochs=1, allow_emulation=True)
    with pytest.raises(ValueError, match="reads the feeds \\['slot_0'"):
        train(dlrm(optimizer=nn.SGD(0.1)).main, ds, epochs=1, allow_emulation=True)


def test_a_truncated_parquet_file_is_named(tmp_path):
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"click": [0, 1] * 8, "row": np.arange(16.0)}), path)
    path.write_bytes(path.read_bytes()[:-20])  # its footer cut off, as an interrupted copy leaves it
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a readable Parquet file"):
        list(open_dataset(path, {"label": "click", "dense": ["row"], "vocab": 10}, batch_size=8))


def test_a_missing_label_names_the_file_and_the_row(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("click,row\n1,2\n,3\n0,4\n")
    with pytest.raises(
        ValueError, match=r"train\.csv \(data rows 1\.\.3\): label column 'click' has 1 missing .*row 2"
    ):
        list(open_dataset(path, {"label": "click", "dense": ["row"], "vocab": 10}, batch_size=8))
