"""`transpile` as a list of passes (transpiler/passes/pipeline.py): on the reference cases it makes the
plans the nested expression of commit 04bed3d made, byte for byte (tests/data/pipeline_04bed3d.json:
each saved file's sha256 and the segments the trainers of that commit cut at start-up), and a pass
that breaks an invariant, or runs before what it requires, is named in the error."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from test_pipeline_cases import CASES, DATA

from transpiler import LintError, Program, TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.models import wide_deep
from transpiler.passes import pipeline
from transpiler.passes.types import Channels, Placement, SegmentOrder, Tables

OLD = json.loads((DATA / "pipeline_04bed3d.json").read_text())
PASSES = pipeline.PASSES


def _sha(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pipeline_makes_the_plans_of_the_nested_expression(case, tmp_path):
    program, config = CASES[case]()
    plan = transpile(program, config)
    root = plan.save(tmp_path / "plan")
    old = OLD[case]
    files = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
    assert files == sorted(old["sha256"])
    for name in files:
        raw = (root / name).read_bytes()
        if name.startswith("programs/"):  # the run segments are new: the rest is the old file
            d = json.loads(raw)
            segments = d.pop("segments")
            assert segments == old["segments"][Path(name).stem], name
            raw = json.dumps(d, indent=1).encode()
        assert _sha(raw) == old["sha256"][name], name


def test_each_pass_returns_its_typed_result_and_leaves_no_attrs():
    program, config = CASES["wide_deep"]()
    before = dict(program.attrs)
    c = pipeline.run_passes(pipeline.PASSES, pipeline.Context(program.clone(), config))
    assert isinstance(c.placement, Placement) and isinstance(c.tables, Tables)
    assert isinstance(c.channels, Channels) and isinstance(c.segment_order, SegmentOrder)
    assert c.loss == program.attrs["loss_name"]
    assert c.program.attrs == before  # nothing handed between passes through Program.attrs
    assert {t: p.segments for t, p in c.programs.items()} == c.segment_order.segments
    assert [p.name for p in pipeline.PASSES] == [
        "append_backward",
        "assign_devices",
        "insert_ps",
        "insert_comm",
        "split",
        "segment_order",
    ]


def _replaced(name: str, run) -> tuple[pipeline.Pass, ...]:
    return tuple(dataclasses.replace(p, run=run) if p.name == name else p for p in PASSES)


def test_a_pass_that_breaks_an_invariant_is_named(monkeypatch):
    real = next(p for p in PASSES if p.name == "insert_comm").run

    def broken(c: pipeline.Context) -> Channels:
        out = real(c)
        c.program.global_block().set_ops(list(c.program.ops)[1:])  # the first op's outputs: gone
        return out

    monkeypatch.setattr(pipeline, "PASSES", _replaced("insert_comm", broken))
    with pytest.raises(LintError, match=r"^after insert_comm: block 0 op #\d+ .* reads .* before anything"):
        transpile(wide_deep(vocab=50, optimizer=nn.SGD(0.1)).main, TranspileConfig())

    def unsplittable(c: pipeline.Context) -> SegmentOrder:
        out = pipeline.order_segments(c.programs)
        c.programs["gpu"].segments[0].pop()  # an op the trainer would never run
        return out

    monkeypatch.setattr(pipeline, "PASSES", _replaced("segment_order", unsplittable))
    with pytest.raises(LintError, match=r"^after segment_order \(trainer gpu\): op id \d+ .* in no segment"):
        transpile(wide_deep(vocab=50, optimizer=nn.SGD(0.1)).main, TranspileConfig())


def test_a_pass_run_before_what_it_requires_is_named():
    passes = tuple(p for p in PASSES if p.name != "assign_devices")
    program = wide_deep(vocab=50, optimizer=nn.SGD(0.1)).main.clone()
    with pytest.raises(ValueError, match=r"pass 'insert_ps' requires \['placement'\], which no pass before"):
        pipeline.run_passes(passes, pipeline.Context(program, TranspileConfig()))


def test_the_source_program_is_linted_before_any_pass():
    program = Program()
    program.global_block().create_var("y")
    program.append_op("relu", {"X": "x"}, {"Y": "y"})
    with pytest.raises(LintError, match=r"^after the source program \(a clone\): .* 'x'"):
        transpile(program)
