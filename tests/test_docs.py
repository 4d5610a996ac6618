"""Every code block of README.md and docs/*.md, extracted and run as a reader would run it.

- `python` blocks run as written; only step counts are made small (`steps=300` -> `steps=N`).
  The README's tour runs as a script in a fresh directory (trainers are spawned processes) and its
  outputs are checked: the plan picture, the metrics JSONL and the Perfetto trace.
- `bash` blocks run command by command: `hetps ...` through the CLI (`runtime.cli.app.main`, step
  counts made small, in a scratch directory holding what the commands read), `python tutorials/...`
  as a subprocess with `--steps` small, `pip install -e ".[X]"` checks that X is an extra of
  setup.py, `pytest -q` checks that the default run leaves out slow tests.
- `yaml` blocks are TranspileConfig files: loaded and applied to the model their page uses; the
  tuning page's sample of a run.yaml is read as the run's settings records.
- `hetps tune`, `inspect --predict` and `runtime.profile.machine.tune` profile this machine for real, once
  per test session, into a cache of the session's own (`XDG_CACHE_HOME`; about 15 s), as a
  newcomer's first run does.
- Blocks for a multi-node Ray cluster (`ray start ...`, `address="auto"` / `--address auto`) cannot
  run on one machine: their flags are checked against `ray start`'s own options, their `train`
  arguments against `train`'s signature and the CLI's parser. `engine="ray"` examples without an
  address run on the session's local Ray.
- Blocks without a language are diagrams.
A block that fits none of these fails `test_every_block_has_a_runner`: add a runner for it.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from assets import MODELS, ROOT

from runtime.cli.app import build_parser, main
from runtime.telemetry.outputs import read_metrics

STEPS = 4
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLUSTER = re.compile(r"address=\"auto\"|--address auto|^ray start", re.M)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(lang: str | None = None) -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            b = Block(
                page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 1, m.group(1), m.group(2)
            )
            if lang is None or b.lang == lang:
                out.append(b)
    return out


def commands(block: Block) -> list[list[str]]:
    """The block's shell commands as argv lists (continuations joined, comments dropped)."""
    text = block.text.replace("\\\n", " ")
    argvs = [shlex.split(line, comments=True) for line in text.splitlines()]
    return [argv for argv in argvs if argv]


def small(text: str) -> str:
    """Step counts made small: `steps=300` / `steps=10_000` and `--steps 300` -> STEPS."""
    text = re.sub(r"\bsteps=[\d_]+", f"steps={STEPS}", text)
    return re.sub(r"--steps \d+", f"--steps {STEPS}", text)


def is_cluster(block: Block) -> bool:
    return bool(CLUSTER.search(block.text))


def test_every_block_has_a_runner():
    known = ("hetps", "pip", "pytest", "python", "ray")
    for b in blocks():
        if b.lang == "bash":
            for argv in commands(b):
                assert argv[0] in known, f"{b}: no runner for `{' '.join(argv)}`"
                if argv[0] == "ray":
                    assert argv[1] == "start" and is_cluster(b), f"{b}: no runner for `{' '.join(argv)}`"
        elif b.lang == "":
            assert re.search("[┌─│►]", b.text), f"{b}: an untagged block that is not a diagram"
        else:
            # text blocks show a sample of output: nothing to run
            assert b.lang in ("python", "yaml", "text"), f"{b}: no runner for {b.lang!r} blocks"
    assert len(blocks("python")) >= 4 and len(blocks("bash")) >= 6  # the extraction finds them


# -- checks of a run's outputs ------------------------------------------------------------------
def check_png(path: Path) -> None:
    from matplotlib.image import imread

    img = imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 200, path
    assert img[..., :3].std() > 0.05, f"{path} is blank"


def check_run(metrics: Path, trace: Path, steps: int, trainers: dict[str, int], servers: int) -> None:
    """run.jsonl: a start record naming the run, one record per step, an end record; trace.json:
    Chrome-trace JSON with one named track per trainer and server and spans on each."""
    recs = read_metrics(metrics)
    assert [r["kind"] for r in recs] == ["start"] + ["step"] * steps + ["tables", "end"]
    assert recs[0]["trainers"] == trainers and recs[0]["servers"] == servers
    losses = [r["loss"] for r in recs if r["kind"] == "step"]
    assert all(np.isfinite(losses)) and 0.3 < losses[0] < 3  # a BCE of an untrained model
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    want = [f"ps shard {i}" for i in range(servers)] + [
        f"trainer {t}:{i}" for t, n in trainers.items() for i in range(n)
    ]
    assert sorted(names.values()) == sorted(want)
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(names)  # every track has spans


# -- python blocks -------------------------------------------------------------------------------
def readme_tour() -> Block:
    return next(b for b in blocks("python") if b.page == "README.md" and "train(" in b.text)


def run_readme_tour(where: Path, text: str, steps: int) -> None:
    """The README's Python tour as a script in `where`; its printout and files checked."""
    script = where / "tour.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=where, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "boundary tensors (bytes per example)" in proc.stdout  # plan.summary()
    for trainer in ("cpu:0", "cpu:1", "gpu:0"):  # hist.time_use()
        assert f"{trainer}: busy" in proc.stdout
    check_png(where / "plan.png")
    check_run(where / "run.jsonl", where / "trace.json", steps, {"cpu": 2, "gpu": 1}, 1)


def test_readme_python_tour_runs_as_a_script_and_writes_what_it_says(tmp_path):
    run_readme_tour(tmp_path, small(readme_tour().text), STEPS)


@pytest.mark.slow
def test_readme_python_tour_exactly_as_written(tmp_path):
    """All 300 steps, as a reader runs it: the `trace=` crash (a trainer dying with `Bad address
    (src/tcp.cpp:227)`) showed only in runs this long."""
    text = readme_tour().text
    run_readme_tour(tmp_path, text, int(re.search(r"\bsteps=(\d+)", text).group(1)))


@pytest.fixture(scope="session")
def profile_cache(tmp_path_factory) -> Path:
    """A profile cache of this session's own (XDG_CACHE_HOME): the first `tune` measures this
    machine as a newcomer's does, later ones read it; the user's ~/.cache is left alone."""
    return tmp_path_factory.mktemp("xdg-cache")


def test_tuning_python_block_tunes_and_trains_the_winner(tmp_path, profile_cache):
    """docs/tuning.md's Python block as a script: it explains the winner, then trains with the
    winner's trainers (the trainers time_use reports are the ones `explain` names)."""
    (b,) = [b for b in blocks("python") if b.page == "docs/tuning.md"]
    script = tmp_path / "tune.py"
    script.write_text(small(b.text))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(profile_cache),
    }
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = re.search(r"^winner: trainers (\S+),", proc.stdout, re.M)
    assert counts, proc.stdout
    want = {f"{t}:{i}" for t, n in (p.split("=") for p in counts.group(1).split(",")) for i in range(int(n))}
    assert set(re.findall(r"^\s*(\w+:\d+): busy", proc.stdout, re.M)) == want, proc.stdout


def test_tuning_run_yaml_sample_reads_as_run_settings(tmp_path):
    """The page's run.yaml sample is what `tune` writes (the tuned scale, batch size and workload)
    and reads as the settings records, within the budget of the page's own `hetps tune` command."""
    from runtime.cli.common import load_settings

    (b,) = [b for b in blocks("yaml") if b.page == "docs/tuning.md"]
    (tmp_path / "run.yaml").write_text(b.text)
    settings, workload = load_settings(str(tmp_path / "run.yaml"))
    scale = settings.scale
    sample = yaml.safe_load(b.text)
    assert set(sample) == {
        "trainers", "micro_batches", "servers", "mode", "batch_size", "cores", "unique_fraction",
        "dense_on_trainer",
    }  # fmt: skip
    assert (scale.trainers, scale.mode, settings.run.batch_size) == (
        sample["trainers"],
        sample["mode"],
        workload.batch_size,
    )
    assert workload.unique_fraction == sample["unique_fraction"]
    (cmd,) = [a for bash in shell_blocks("docs/tuning.md") for a in commands(bash) if a[1] == "tune"]
    budget = dict(p.split("=") for p in cmd[cmd.index("--budget") + 1].split(","))
    assert scale.trainers["cpu"] + scale.servers <= int(budget["cpu"])
    assert scale.trainers.get("gpu", 0) <= int(budget["gpu"])


def test_api_builder_block_builds_a_trainable_program():
    b = next(b for b in blocks("python") if b.page == "docs/api.md")
    ns: dict = {}
    exec(compile(b.text, str(b), "exec"), ns)
    main_prog = ns["main"]
    assert [op.type for op in main_prog.ops].count("adam") == len(main_prog.parameters())
    assert any(v.is_sparse for v in main_prog.parameters())
    # one run of `main` is one training step: it runs on a batch and gives a finite loss
    from runtime import Executor
    from runtime.data import SyntheticCTR

    exe = Executor()
    exe.run(ns["startup"])
    feed = SyntheticCTR(vocab=1000).batch(0, 32)
    losses = [float(exe.run(main_prog, feed=feed, fetch_list=[ns["loss"]])[0]) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[2] < losses[0]  # the same batch: Adam steps lower it


def cluster_namespace() -> dict:
    """What the cluster page's fragments assume exists: a plan and a data source."""
    from runtime.data import SyntheticCTR
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    plan = transpile(wide_deep(vocab=1000, dim=4, hidden=(16,), optimizer=nn.SGD(lr=0.05)).main)
    return {"plan": plan, "data": SyntheticCTR(vocab=1000)}


def test_cluster_python_blocks(ray_local):
    import runtime

    py = [b for b in blocks("python") if b.page == "docs/cluster.md"]
    assert py
    for b in py:
        code = small(b.text)
        ns = cluster_namespace()
        if is_cluster(b):  # a two-node cluster: the call's arguments must be train's
            call = re.search(r"train\((.*)\)", code, re.S).group(1)
            args = eval(f"(lambda *a, **k: (a, k))({call})", {**ns})
            inspect.signature(runtime.train).bind(*args[0], **args[1])
            continue
        exec(compile(code if "import" in code else "from runtime import train\n" + code, str(b), "exec"), ns)
        assert ns["hist"].steps == STEPS, b


# -- yaml blocks ---------------------------------------------------------------------------------
def test_cli_config_example_places_what_its_comments_say(tmp_path):
    from transpiler import TranspileConfig, from_onnx, transpile

    (b,) = [b for b in blocks("yaml") if b.page == "docs/cli.md" and "trainer_types" in b.text]
    (tmp_path / "plan.yaml").write_text(b.text)
    config = TranspileConfig.load(tmp_path / "plan.yaml")
    plan = transpile(from_onnx(MODELS / "wide_deep.onnx", loss="bce"), config)
    placed = {p["type"]: p["device"] for p in plan.placement.values() if p["type"] in ("reduce_sum",)}
    assert placed == {"reduce_sum": "cpu"}
    assert "matches 'p2o.pd_op.matmul.3*'" in plan.explain("p2o.pd_op.matmul.3.0")
    assert (
        plan.placement[
            next(k for k, r in plan.placement.items() if "p2o.pd_op.matmul.3*" in r.get("reason", ""))
        ]["device"]
        == "cpu"
    )
    assert {t.optimizer.type for t in plan.tables if t.optimizer} == {"adam"}


# -- bash blocks ---------------------------------------------------------------------------------
def criteo_file(path: Path, lines: int = 64) -> None:
    """A small file in the Criteo format (label, 13 integers, 26 hex categoricals; tabs)."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(lines):
            ints = [str(v) for v in rng.integers(0, 50, 13)]
            cats = [f"{v:08x}" for v in rng.integers(0, 1 << 32, 26)]
            f.write("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]) + "\n")


def run_hetps(argv: list[str], where: Path) -> None:
    """`hetps ARGS` through the CLI in `where`, with paths to the repo's files made absolute."""
    argv = [str(ROOT / a) if a.startswith("tutorials/") else a for a in argv[1:]]
    cwd = os.getcwd()
    os.chdir(where)
    try:
        assert main(argv) == 0, argv
    finally:
        os.chdir(cwd)


def shell_blocks(page: str) -> list[Block]:
    return [b for b in blocks("bash") if b.page == page]


def hetps_blocks() -> list[Block]:
    """Shell blocks of `hetps` commands that run on one machine (each in a directory of its own)."""
    return [
        b
        for b in blocks("bash")
        if "hetps train" in b.text
        and not is_cluster(b)
        and b.page != "docs/cluster.md"
        and "--resume" not in b.text  # the checkpoint/resume block: test_resume_block
        and "--model" not in b.text  # the whole path from a click log: test_whole_path_block
    ]


def run_shell_block(block: Block, where: Path, exact: bool) -> None:
    """Run a block's `hetps` commands in `where` (step counts small unless `exact`); check the
    run's metrics and trace and the pictures it draws."""
    text = block.text if exact else small(block.text)
    for argv in commands(Block(block.page, block.line, block.lang, text)):
        run_hetps(argv, where)
    train = next(a for a in commands(block) if a[1] == "train")
    option = {a: train[i + 1] for i, a in enumerate(train) if a.startswith("--") and i + 1 < len(train)}
    # the run's settings: flags, else the --settings file an earlier command wrote, else train's defaults
    settings = yaml.safe_load((where / option["--settings"]).read_text()) if "--settings" in option else {}
    if "--trainers" in option or "trainers" not in settings:
        counts = dict(p.split("=") for p in option.get("--trainers", "cpu=2,gpu=1").split(","))
    else:
        counts = settings["trainers"]
    assert "--metrics" in option and "--trace" in option, f"{block}: a tour records metrics and a trace"
    check_run(
        where / option["--metrics"],
        where / option["--trace"],
        int(option["--steps"]) if exact else STEPS,
        {k: int(v) for k, v in counts.items()},
        int(option.get("--servers", settings.get("servers", 1))),
    )
    for png in re.findall(r"-o (\S+\.png)", block.text):
        check_png(where / png)


@pytest.mark.parametrize("block", hetps_blocks(), ids=str)
def test_shell_blocks_run_through_the_cli_and_write_what_they_say(
    block, tmp_path, profile_cache, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(profile_cache))
    run_shell_block(block, tmp_path, exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("block", hetps_blocks(), ids=str)
def test_shell_blocks_exactly_as_written(block, tmp_path, profile_cache, monkeypatch):
    """Every step the page asks for (the `trace=` crash showed only in long runs)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(profile_cache))
    run_shell_block(block, tmp_path, exact=True)


def test_the_shell_tours_are_found():
    assert {b.page for b in hetps_blocks()} == {"README.md", "docs/cli.md", "docs/tuning.md"}


def test_cluster_shell_blocks(ray_local, tmp_path):
    from ray.scripts.scripts import start

    ray_start_flags = {o.split("=")[0] for p in start.params for o in p.opts}
    run_hetps(
        ["hetps", "transpile", "tutorials/models/wide_deep.onnx", "--loss", "bce", "--out", "plan/"], tmp_path
    )  # the plan/ the page's commands train
    criteo_file(tmp_path / "criteo_day0.txt")
    ran = 0
    for b in shell_blocks("docs/cluster.md"):
        for argv in commands(Block(b.page, b.line, b.lang, small(b.text))):
            if argv[0] == "pip":
                check_pip(argv, b)
            elif argv[0] == "ray":
                for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
                    assert flag in ray_start_flags, f"{b}: `ray start` has no {flag}"
            elif is_cluster(b):
                build_parser().parse_args(argv[1:])  # exits (SystemExit) on a flag that does not exist
            else:
                run_hetps(argv, tmp_path)
                ran += 1
    assert ran >= 1


def check_pip(argv: list[str], b: Block) -> None:
    extras = set(re.findall(r'^\s+"(\w+)": \[', (ROOT / "setup.py").read_text(), re.M))
    assert argv[:3] == ["pip", "install", "-e"], b
    spec = re.fullmatch(r"\.\[(\w+)\]", argv[3])
    assert spec and spec.group(1) in extras, f"{b}: {argv[3]} is not an extra of setup.py ({extras})"


def test_readme_quick_start_commands(tmp_path):
    (b,) = [b for b in shell_blocks("README.md") if "pip install" in b.text]
    for argv in commands(b):
        if argv[0] == "pip":
            check_pip(argv, b)
        elif argv[0] == "pytest":  # not the suite inside itself: its default run leaves slow tests out
            assert argv == ["pytest", "-q"]
            assert '-m "not slow"' in (ROOT / "pytest.ini").read_text()
        else:
            assert argv[0] == "python" and argv[1].startswith("tutorials/")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            proc = subprocess.run(
                [sys.executable, str(ROOT / argv[1]), *argv[2:], "--steps", "20"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "final held-out AUC" in proc.stdout


def test_cli_schema_example_reads_a_csv_as_its_comments_say(tmp_path):
    """cli.md's schema block, applied to a 3-row CSV: rating >= 4 is positive, genres split on '|'."""
    from runtime.data import open_dataset

    (b,) = [b for b in blocks("yaml") if b.page == "docs/cli.md" and "label_threshold" in b.text]
    (tmp_path / "schema.yaml").write_text(b.text)
    (tmp_path / "items.txt").write_text("i1\ni2\n")
    (tmp_path / "r.csv").write_text(
        "user_id,item_id,gender,occupation,age,genres,rating\n"
        "u1,i2,M,7,20,Drama|Comedy,5\nu2,i9,F,3,30,Drama,2\nu1,i1,M,7,40,,4\n"
    )
    (batch,) = list(open_dataset(tmp_path / "r.csv", tmp_path / "schema.yaml", batch_size=3))
    assert batch["label"].ravel().tolist() == [1.0, 0.0, 1.0]
    assert batch["sparse"].shape == (3, 4) and batch["dense"].shape == (3, 1)
    np.testing.assert_allclose(batch["dense"].ravel(), [-1.2247449, 0.0, 1.2247449], rtol=1e-5)  # standardize
    assert batch["sparse"][:, 1].tolist()[::2] == [2, 1]  # listed items get ids 1..K in file order
    assert batch["genres"][0, :2].all() and (batch["genres"][1, 1:] == 0).all()  # a bag, padded with 0


def test_resume_block_checkpoints_evaluates_and_resumes(tmp_path, capsys):
    """cli.md's checkpoint / resume block with its step counts scaled by 1/50: the second run starts
    where the first one's last checkpoint is, and the metrics hold both runs' held-out evaluations."""
    (b,) = [b for b in blocks("bash") if "--resume" in b.text]
    text = re.sub(
        r"--(steps|checkpoint-every|eval-every) (\d+)", lambda m: f"--{m[1]} {int(m[2]) // 50}", b.text
    )
    outputs = []
    for argv in commands(Block(b.page, b.line, b.lang, text)):
        run_hetps(argv, tmp_path)
        outputs.append(capsys.readouterr().out)
    assert "resumed at step 4" in outputs[2], outputs[2]
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert ckpts == ["step-00000004", "step-00000006"], ckpts  # every 2 steps, the newest 2 kept
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6]  # every 2 steps and at the ends
    check_png(tmp_path / "curves.png")
    held_out = json.loads(outputs[-1])  # `hetps eval --workers 2 --servers 2` of the last checkpoint
    assert held_out["examples"] > 0 and 0.0 <= held_out["auc"] <= 1.0, held_out


@pytest.mark.slow
def test_whole_path_block_runs_on_a_click_log(tmp_path, capsys):
    """cli.md's whole shell path on a generated click log: every command runs, and the scores
    onnxruntime prints for the raw rows are the ones `hetps predict` wrote."""
    sys.path.insert(0, str(ROOT / "tests" / "runtime" / "cli"))
    from test_user_path import SCHEMA, _log

    (b,) = [b for b in blocks("bash") if b.page == "docs/cli.md" and "--model wide_deep" in b.text]
    (tmp_path / "schema.yaml").write_text(SCHEMA)
    _log(tmp_path / "train.csv", 800, 0)
    _log(tmp_path / "test.csv", 200, 1)
    printed = ""
    for argv in commands(b):
        if argv[0] == "hetps":
            argv = [*argv, "--trainers", "cpu=1,gpu=1"] if argv[1] == "train" else argv
            run_hetps(argv, tmp_path)
        else:
            assert argv[:2] == ["python", "-c"], argv
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            printed = subprocess.run(
                argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=True
            ).stdout
    served = np.array([float(v) for v in re.findall(r"[\d.e-]+", printed)])
    scores = np.loadtxt(tmp_path / "scores.csv")[:5]
    np.testing.assert_allclose(served, scores, rtol=1e-6)
