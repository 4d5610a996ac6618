"""The Plan, what `transpile` returns: one sub-program per trainer type, the parameter-server tables,
the channels between trainer types, the config, and why every op runs where it does.

A plan directory holds `plan.json` (tables, channels, config, placement reasons), one
`programs/<trainer type>.json` per sub-program (with the run segments the segment-order pass
stored in it, `Program.segments`; a plan saved before that pass has none, and its trainers run
segments cut at recv ops) and, when the source program carried parameter values (ONNX / Paddle
imports), `params.npz`.

A table: a `transpiler.tables.TableSpec` (in plan.json as its `to_dict`, the format of old plans).
A channel: {"tensor", "src", "dst", "shape", "dtype", "bytes_per_example", "direction"}.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transpiler.config import TranspileConfig
from transpiler.errors import PlanError
from transpiler.ir import Op, Program
from transpiler.passes import pipeline, verify
from transpiler.show_click import ShowClick, record_show_click, show_click_of
from transpiler.tables import OptimizerSpec, TableSpec, tables_from_dicts, tables_to_dicts
from transpiler.tasks import task_names
from transpiler.values import load_params, save_params


@dataclass
class Plan:
    """A transpiled program. `placement` maps str(op id) -> {"type", "device", "reason"} for every op
    of the source program (optimizer ops: device "ps") and every op the passes inserted."""

    programs: dict[str, Program]
    tables: list[TableSpec]
    channels: list[dict[str, Any]]
    config: TranspileConfig = field(default_factory=TranspileConfig)
    placement: dict[str, dict[str, str]] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    loss_name: str | None = None

    @property
    def trainer_types(self) -> list[str]:
        return list(self.programs)

    @property
    def reader_types(self) -> list[str]:
        """The trainer types that own data ops (read the feeds); a trainable plan has exactly one."""
        return [t for t, p in self.programs.items() if p.attrs.get("feeds")]

    @property
    def reader(self) -> str:
        """The one trainer type that owns the data ops; ValueError when there is not exactly one."""
        readers = self.reader_types
        if len(readers) != 1:
            raise ValueError(
                f"exactly one trainer type must own the data ops, found {readers or 'none'}; "
                "place every data op on one type (e.g. config.op_type_devices={'data': 'cpu'})"
            )
        return readers[0]

    @property
    def tasks(self) -> list[str]:
        """The task names of a multi-task plan, in order ([] for one loss; transpiler/tasks.py)."""
        return task_names(self.programs)

    @property
    def loss_reduction(self) -> str:
        """ "sum" for a reduce_sum loss, else "mean": how the loss of a batch is made of its items'
        (and how losses over batches or micro-batches combine)."""
        op = next(
            (
                op
                for p in self.programs.values()
                for op in p.ops
                if self.loss_name in op.output_names() and op.role != "comm"
            ),
            None,
        )
        return "sum" if op is not None and op.type == "reduce_sum" else "mean"

    @property
    def show_click_feeds(self) -> dict[str, ShowClick]:
        """Per sparse table with a lifecycle: the label and id feeds its rows' show/click counts come
        from, sent by the reader's trainers with their pushes (transpiler/show_click.py)."""
        return {k: v for p in self.programs.values() for k, v in show_click_of(p).items()}

    @property
    def clipped_tables(self) -> list[str]:
        """The tables whose gradients are clipped by global norm: such a plan trains in sync mode
        only (the norm needs every gradient of a step; async applies each push on arrival)."""
        return sorted(t.name for t in self.tables if t.clip_norm is not None)

    def pushers(self) -> dict[str, list[str]]:
        """Per table: the trainer types that push it (gradients to the servers), in program order."""
        out: dict[str, list[str]] = {}
        for t, p in self.programs.items():
            pushed = (op.attrs["table"] for op in p.ops if op.type in ("push_dense", "push_sparse"))
            for table in dict.fromkeys(pushed):
                out.setdefault(table, []).append(t)
        return out

    def pushes(self, counts: dict[str, int]) -> dict[str, int]:
        """Per table: the trainer processes that push it each step, with `counts` trainers per type."""
        return {table: sum(counts[t] for t in types) for table, types in self.pushers().items()}

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table {name!r} in the plan; tables: {[t.name for t in self.tables]}")

    # -- checks and explanations ---------------------------------------------------------
    def verify(self) -> None:
        """Raise `PlanError` listing every problem (see transpiler.passes.verify)."""
        verify(self.programs, self.tables)

    def explain(self, op: Op | int | str) -> str:
        """Why an op (an Op, an op id, or the name of a var it produces) runs where it does."""
        if isinstance(op, str):
            op = self._producer(op)
        key = str(op.id if isinstance(op, Op) else op)
        if key not in self.placement:
            raise KeyError(f"op id {key} is not in this plan's placement record")
        p = self.placement[key]
        return f"op id {key} {p['type']!r} -> {p['device']}: {p['reason']}"

    def _producer(self, var: str) -> int:
        for prog in self.programs.values():
            for op in prog.ops:
                if op.role != "comm" and any(var in names for names in op.outputs.values()):
                    return op.id
        raise KeyError(f"no op of the plan produces {var!r}")

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the plan directory (plan.json, programs/<type>.json, params.npz)."""
        path = Path(path)
        (path / "programs").mkdir(parents=True, exist_ok=True)
        for dev, prog in self.programs.items():
            (path / "programs" / f"{dev}.json").write_text(prog.to_json(indent=1))
        meta = {
            "version": 1,
            "trainer_types": self.trainer_types,
            "loss_name": self.loss_name,
            "config": self.config.to_dict(),
            "tables": tables_to_dicts(self.tables),
            "channels": self.channels,
            "placement": self.placement,
        }
        (path / "plan.json").write_text(json.dumps(meta, indent=1))
        if self.params:
            save_params(self.params, path / "params.npz")
        return path

    @classmethod
    def load(cls, path: str | Path, *, check: bool = True) -> Plan:
        """Read a plan directory written by `save`. Only files inside it are read: a trainer type
        must be a plain name (a hand-edited `"../../x"` is refused), and a file that resolves
        outside the directory (a symbolic link) is refused. With `check` the plan is verified
        (`verify`), so an unknown op, a tensor nobody makes or a cycle is refused here, before
        anything runs; `check=False` loads a broken plan to look at it."""
        path = Path(path)
        if not (path / "plan.json").exists():
            raise FileNotFoundError(f"{path} is not a plan directory: no plan.json (make one with Plan.save)")
        meta = _read_json(_inside(path, "plan.json"))
        types = meta.get("trainer_types") if isinstance(meta, dict) else None
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise PlanError(f"{path / 'plan.json'}: 'trainer_types' must be a list of names, got {types!r}")
        for t in types:
            if t in ("", ".", "..") or Path(t).name != t or "\\" in t:
                raise PlanError(
                    f"{path / 'plan.json'}: trainer type {t!r} is not a plain name (like "
                    "'cpu'); a plan reads only its own files, programs/<type>.json"
                )
        programs = {t: Program.from_dict(_read_json(_inside(path, "programs", f"{t}.json"))) for t in types}
        params = load_params(_inside(path, "params.npz")) if (path / "params.npz").exists() else {}
        try:
            tables = tables_from_dicts(meta.get("tables"))
        except ValueError as e:
            raise PlanError(f"{path / 'plan.json'}: {e}") from None
        plan = cls(
            programs,
            tables,
            meta["channels"],
            TranspileConfig.from_dict(meta["config"]),
            meta["placement"],
            params,
            meta["loss_name"],
        )
        if check:
            plan.verify()
        return plan

    # -- views ----------------------------------------------------------------------------
    def summary(self, profile: Any = None, scale: Any = None, workload: Any = None) -> str:
        """Ops per trainer type, each boundary tensor with bytes per example, each table; given a
        `transpiler.cost.profile.Profile`, also the predicted examples/s and bottleneck role for `scale`
        (a `transpiler.settings.ScaleConfig`; default one trainer per type, the config's servers and
        mode) on `workload` (a `cost.model.Workload`)."""
        lines = [
            f"plan: {len(self.programs)} trainer types, {len(self.tables)} tables, "
            f"{len(self.channels)} boundary tensors; ps mode {self.config.mode}, "
            f"{self.config.num_servers} server(s)"
        ]
        for dev, prog in self.programs.items():
            roles: dict[str, int] = {}
            for op in prog.ops:
                roles[op.role] = roles.get(op.role, 0) + 1
            lines.append(
                f"trainer {dev}: {len(prog.ops)} ops ("
                + ", ".join(f"{n} {r}" for r, n in roles.items())
                + ")"
            )
        lines.append("boundary tensors (bytes per example):")
        totals: dict[tuple[str, str], int] = {}
        for c in self.channels:
            shape = c["shape"] if c["shape"] is not None else "?"
            lines.append(
                f"  {c['src']:>4} -> {c['dst']:<4} {c['direction']:<8} {c['tensor']:<32} "
                f"{c['dtype']}{shape}  {c['bytes_per_example']} B"
            )
            k = (c["src"], c["dst"])
            totals[k] = totals.get(k, 0) + c["bytes_per_example"]
        lines += [f"  total {s} -> {d}: {n} B per example" for (s, d), n in totals.items()]
        lines.append("tables:")
        for t in self.tables:
            opt_s = "frozen" if not t.optimizer else _describe_optimizer(t.optimizer)
            shape = " x ".join(map(str, t.shape))
            shard = t.sharding.shard if t.sharding is not None else None
            lines.append(
                f"  {t.name:<24} {t.kind:<6} {shape} {t.dtype}  {opt_s}  "
                f"shard {'by id hash' if shard is None else shard}"
            )
        if profile is not None:
            from transpiler.cost.model import predict
            from transpiler.settings import ScaleConfig

            scale = scale or ScaleConfig({t: 1 for t in self.programs})
            lines.append(predict(self, profile, scale, workload).describe())
        return "\n".join(lines)

    def to_onnx(self, path: str | Path) -> list[Path]:
        """One `<trainer type>.onnx` per sub-program (comm and PS ops as custom-domain nodes)."""
        import onnx

        from transpiler.exporters.onnx import to_onnx

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        out = []
        for dev, prog in self.programs.items():
            f = path / f"{dev}.onnx"
            onnx.save(to_onnx(prog), str(f))
            out.append(f)
        return out

    def export_inference(
        self,
        path: str | Path,
        tables: dict[str, np.ndarray],
        output: str | None = None,
        opset: int | None = None,
    ) -> Path:
        """One servable ONNX model at `path`: the forward graph predicting `output`, with `tables`
        (full arrays by table name) as initializers (see transpiler/exporters/servable.py). With a
        checkpoint: `runtime.export(plan, path, checkpoint=DIR)` (or `hetps export --inference`)."""
        from transpiler.exporters.servable import export_inference

        return export_inference(self, path, tables, output, opset)

    def draw(self, path: str | Path) -> Path:
        """A picture of the op graph laid out by Graphviz `dot` (`.png`, `.svg` for big graphs, `.pdf`):
        ops in one box per trainer type, data feeds and boundary tensors labelled with their names,
        dtype[shape] and bytes per example, a legend (see transpiler/exporters/draw.py)."""
        from transpiler.exporters.draw import draw_plan

        return draw_plan(self, Path(path))


def _read_json(f: Path) -> Any:
    """The JSON document in plan file `f`; PlanError naming the file when it is not JSON."""
    try:
        return json.loads(f.read_bytes())
    except ValueError as e:
        raise PlanError(f"{f} is not valid JSON ({e}); a plan directory is written by Plan.save") from None


def _inside(root: Path, *parts: str) -> Path:
    """root/parts, refused (PlanError) when it resolves outside `root` (e.g. a symbolic link)."""
    f = root.joinpath(*parts)
    if not f.resolve().is_relative_to(root.resolve()):
        raise PlanError(
            f"{f} resolves to {f.resolve()}, outside the plan directory {root}; a plan "
            "reads only its own files"
        )
    return f


def transpile(program: Program, config: TranspileConfig | None = None) -> Plan:
    """Split a single-process training program into a heterogeneous parameter-server Plan.

    The passes of `transpiler.passes.pipeline.PASSES` run on a clone of `program`, linted after each;
    the Plan is made from their typed results and verified before it is returned. A program
    without backward ops but with `attrs["loss_name"]` (e.g. an ONNX import with a loss) gets its
    backward ops first.
    """
    with _gc_paused():
        return _transpile(program, config or TranspileConfig())


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Transpiling makes a few objects per op and no reference cycles; the cyclic collector's
    repeated scans of them made it 1.7-2x slower (measured on 10k- and 100k-op programs)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _transpile(program: Program, config: TranspileConfig) -> Plan:
    c = pipeline.run_passes(pipeline.PASSES, pipeline.Context(program.clone(), config))
    assert c.placement and c.tables and c.channels and c.programs is not None
    placement = {k: {"type": type, "device": dev} for k, (type, dev) in c.placement.ops.items()}
    inserted = [op for op in c.program.ops if op.role in ("comm", "ps")]
    placement.update({str(op.id): {"type": op.type, "device": op.device} for op in inserted})
    for reasons in (c.placement.reasons, c.tables.reasons, c.channels.reasons):
        for k, reason in reasons.items():
            placement[k]["reason"] = reason
    record_show_click(c.programs, c.tables.specs)
    plan = Plan(
        c.programs, c.tables.specs, c.channels.channels, config, placement, dict(c.program.params), c.loss
    )
    plan.verify()
    return plan


def _describe_optimizer(spec: OptimizerSpec) -> str:
    """`adamw(lr=0.003, schedule=linear_warmup>cosine, weight_decay=0.01, l2=0.001)` (set rules only)."""
    opt = spec.hyper
    parts, sched = [f"lr={opt.get('lr')}"], opt.get("lr_schedule")
    names = []
    while sched:
        names.append(sched["type"])
        sched = sched.get("then")
    if names:
        parts.append("schedule=" + ">".join(names))
    if opt.get("weight_decay"):
        parts.append(f"weight_decay={opt['weight_decay']}")
    if opt.get("l2_decay"):
        parts.append(f"l2={opt['l2_decay']}")
    if opt.get("paddle_sparse"):
        parts.append("paddle_sparse")
    return f"{spec.type}({', '.join(parts)})"
