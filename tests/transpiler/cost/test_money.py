"""Tuning for money (transpiler/cost/money.py, the tuner's objectives) and predictions on paper
(transpiler/cost/paper.py), against figures computed by hand: the tuner is given a table of
predicted examples/s per setting, and each objective's winner and runner-up, $ per hour, per million
examples and per epoch are worked out below in the comments."""

from __future__ import annotations

import pytest
from test_cost import dense_model, gemm_price, synthetic_profile

from transpiler import transpile
from transpiler.cost.model import PlanCost, Prediction, Workload
from transpiler.cost.money import Costing, MachineType, Objective, Prices, resources
from transpiler.cost.paper import Cluster
from transpiler.cost.tune import best_setting, tried_counts
from transpiler.settings import ScaleConfig

PRICES = Prices(cpu=0.048, gpu=2.50)
# setting -> examples/s; cores = cpu trainers + shards, GPUs = gpu trainers; $/h = 0.048 c + 2.5 g
TABLE = [
    (ScaleConfig({"cpu": 1, "gpu": 1}, 1, 1, "sync"), 100_000),  # 2 cores, 1 GPU: $2.596/h
    (ScaleConfig({"cpu": 3, "gpu": 1}, 1, 2, "sync"), 180_000),  # 5 cores, 1 GPU: $2.740/h
    (ScaleConfig({"cpu": 4, "gpu": 2}, 1, 2, "sync"), 260_000),  # 6 cores, 2 GPUs: $5.288/h
    (ScaleConfig({"cpu": 6, "gpu": 1}, 1, 3, "sync"), 200_000),  # 9 cores, 1 GPU: $2.932/h
]
S1, S2, S3, S4 = (s for s, _ in TABLE)


class Table:
    """The cost model's interface (`predict`) over a table of examples/s, for the objectives alone."""

    def predict(self, s: ScaleConfig, w: Workload | None = None) -> Prediction:
        eps = next(e for t, e in TABLE if t == s)
        return Prediction(eps, 512 / eps, "gpu", "by hand", [], s, w or Workload(), eps, eps)


def pick(objective: Objective) -> tuple[ScaleConfig, ScaleConfig | None]:
    win, second = best_setting(Table(), [s for s, _ in TABLE], None, objective)
    return win.scale, second.scale if second else None


def test_price_of_a_setting_by_hand():
    assert resources(S4) == (9, 1)
    assert PRICES.hourly(9, 1)[0] == pytest.approx(9 * 0.048 + 2.5)  # 2.932
    c = Costing(2.932, "", 200_000, 100_000_000)
    # $2.932/h / 3600 s = $8.1444e-4 per s; at 200k examples/s: 4.0722e-9 $ per example
    assert c.per_million == pytest.approx(4.0722e-3, rel=1e-4)
    assert c.per_epoch == pytest.approx(0.40722, rel=1e-4)  # 1e8 examples: 500 s
    assert c.epoch_hours == pytest.approx(500 / 3600)


def test_machine_types_rent_the_cheapest_count_of_one_type():
    prices = Prices(machines=(MachineType("c16", 16, 0, 0.80), MachineType("g8", 8, 1, 3.00)))
    assert prices.hourly(20, 0)[0] == pytest.approx(1.60)  # 2 x c16 (3 x g8 would be 9.00)
    assert prices.hourly(4, 2)[0] == pytest.approx(6.00)  # GPUs: only g8, two of them
    assert "2 x g8" in prices.hourly(4, 2)[1]


def test_most_examples_per_dollar_by_hand():
    # examples per $ = eps * 3600 / $/h: S1 138.7M, S2 236.5M, S3 177.0M, S4 245.6M
    assert pick(Objective("per_dollar", PRICES)) == (S4, S2)


def test_cheapest_reaching_a_target_by_hand():
    # >= 200k: S3 ($5.288/h) and S4 ($2.932/h): S4, then S3
    assert pick(Objective("target", PRICES, target=200_000)) == (S4, S3)
    assert pick(Objective("target", PRICES, target=250_000)) == (S3, None)
    with pytest.raises(ValueError, match=r"reaching 300,000 examples/s.*fastest predicted.*260,000"):
        pick(Objective("target", PRICES, target=300_000))


def test_fastest_within_a_budget_per_hour_by_hand():
    # <= $2.80/h: S1 ($2.596) and S2 ($2.740): S2 is the faster; <= $3: S4 (200k) then S2
    assert pick(Objective("budget", PRICES, max_hourly=2.80)) == (S2, S1)
    assert pick(Objective("budget", PRICES, max_hourly=3.00)) == (S4, S2)
    assert pick(Objective()) == (S3, S4)  # no prices: the fastest


def test_bad_prices_name_the_culprit(tmp_path):
    with pytest.raises(ValueError, match="cpu=0.048,gpu=2.50"):
        Prices.parse("cpu=cheap")
    with pytest.raises(ValueError, match="needs prices"):
        Objective("per_dollar")
    with pytest.raises(ValueError, match="target > 0"):
        Objective("target", PRICES)
    path = tmp_path / "prices.yaml"
    path.write_text("machines:\n  g8: {cpu: 8, gpu: 1, hourly: 3.0}\n")
    assert Prices.parse(str(path)).hourly(8, 1)[0] == pytest.approx(3.0)
    path.write_text("machines:\n  g8: {cores: 8}\n")
    with pytest.raises(ValueError, match="cpu, gpu and hourly"):
        Prices.load(path)


def test_large_budgets_are_searched_on_a_coarse_grid():
    assert tried_counts(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert tried_counts(63) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 27, 40, 60, 63]


def test_cluster_profile_adds_the_network_by_hand():
    c = Cluster.parse("nodes=4,cores=16,gpus=2,bandwidth=10Gbit,latency=50us,gpu-speedup=20")
    assert (c.bandwidth, c.latency_s, c.crossing) == pytest.approx((1.25e9, 50e-6, 0.75))
    plan = transpile(dense_model())
    prof = synthetic_profile(plan, gemm_price, link=(1e-4, 1e-8), ps=(5e-4, 1e-6, 0.0), emulated=["gpu"])
    paper = c.profile(prof)
    assert paper.link.latency_s == pytest.approx(1e-4 + 0.75 * 50e-6)
    assert paper.link.per_byte_s == pytest.approx(1e-8 + 0.75 / 1.25e9)
    assert paper.ps.request_s == pytest.approx(5e-4 + 0.75 * 2 * 50e-6)
    gemm = next(s for s in prof.kernels["gpu"] if s.startswith("gemm:"))
    assert paper.kernels["gpu"][gemm].fixed_s == pytest.approx(prof.kernels["gpu"][gemm].fixed_s / 20)
    assert paper.emulated == [] and prof.emulated == ["gpu"]  # the measured profile is left alone
    assert c.workload(Workload(512, 2, 1.0, 0.5, 0.3)).cores == 64
    one = Cluster.parse("cores=16,gpus=1").profile(prof)
    assert one.link.latency_s == pytest.approx(1e-4)  # one node: nothing crosses a network
    with pytest.raises(ValueError, match="bandwidth.*10Gbit"):
        Cluster.parse("bandwidth=fast")


def test_per_dollar_tuning_of_a_real_plan_pays_for_what_it_uses():
    """On a synthetic profile, every setting's examples per $ (by the model's own examples/s, priced
    by hand) is at most the winner's."""
    plan = transpile(dense_model())
    prof = synthetic_profile(plan, gemm_price, link=(1e-4, 1e-8), ps=(5e-4, 1e-6, 0.0))
    cost = PlanCost(plan, prof)
    grid = [ScaleConfig({"cpu": c, "gpu": g}, 1, s, "sync") for c in (1, 2) for g in (1, 2) for s in (1, 2)]
    win, _ = best_setting(cost, grid, Workload(64), Objective("per_dollar", PRICES))
    per_dollar = [
        cost.predict(s, Workload(64)).examples_per_s
        / (0.048 * (s.trainers["cpu"] + s.servers) + 2.5 * s.trainers["gpu"])
        for s in grid
    ]
    won = cost.predict(win.scale, Workload(64)).examples_per_s / (
        0.048 * (win.scale.trainers["cpu"] + win.scale.servers) + 2.5 * win.scale.trainers["gpu"]
    )
    assert won == pytest.approx(max(per_dollar))


def _cli(tmp_path, *extra: str) -> tuple[int, str]:
    """`hetps tune` of a small Wide&Deep's plan directory (resources only: fast) on a synthetic
    profile (every kernel 0.1 ms + 1 us per example), with `extra` options; (exit code, output)."""
    import contextlib
    import io
    import json

    from runtime.cli.app import main
    from transpiler import builder
    from transpiler.cost.profile import KernelCost
    from transpiler.models import wide_deep

    if not (tmp_path / "plan").is_dir():
        model = wide_deep(
            num_slots=2, vocab=50, dim=4, num_dense=3, hidden=(8,), optimizer=builder.SGD(lr=0.1)
        )
        model.main.save(tmp_path / "model.json")
        assert main(["transpile", str(tmp_path / "model.json"), "--out", str(tmp_path / "plan")]) == 0
        prof = synthetic_profile(
            transpile(model.main),
            lambda k, op: KernelCost(1e-4, 1e-6),
            link=(1e-5, 1e-9),
            ps=(1e-4, 1e-9, 1e-9),
        )
        (tmp_path / "prof.json").write_text(json.dumps(prof.to_dict()))
    out = io.StringIO()
    argv = [
        "tune",
        str(tmp_path / "plan"),
        "--out",
        str(tmp_path / "t"),
        "--profile",
        str(tmp_path / "prof.json"),
    ]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main([*argv, *extra])
    return rc, out.getvalue()


def test_cli_prints_the_money_of_the_chosen_setting_and_the_runner_up(tmp_path):
    """The $ figures printed follow from the examples/s and $/h printed beside them (by hand)."""
    import re

    rc, text = _cli(
        tmp_path, "--budget", "cpu=4,gpu=2", "--prices", "cpu=0.048,gpu=2.50", "--epoch-examples", "1000000"
    )
    assert rc == 0, text
    rows = re.findall(
        r"(chosen|runner-up): trainers cpu=(\d+),gpu=(\d+), \d+ micro-batches, (\d+) server\(s\), \w+: "
        r"([\d,]+) examples/s for \$([\d.]+)/h .*: \$([\d.e+-]+) per million examples, "
        r"\$([\d.e+-]+) per epoch",
        text,
    )
    assert [r[0] for r in rows] == ["chosen", "runner-up"], text
    for _, cpu, gpu, servers, eps, hourly, per_m, per_epoch in rows:
        eps = float(eps.replace(",", ""))
        assert float(hourly) == pytest.approx(0.048 * (int(cpu) + int(servers)) + 2.5 * int(gpu), abs=1e-3)
        assert float(per_m) == pytest.approx(float(hourly) / 3600 / eps * 1e6, rel=0.02, abs=1e-4)
        assert float(per_epoch) == pytest.approx(float(hourly) / 3600 * 1e6 / eps, rel=0.02, abs=0.01)
    assert "why: the most examples per $" in text and "GPUs are" in text


def test_cli_money_options_and_paper_predictions(tmp_path):
    """An unreachable target, a target without prices, and predictions on paper (with and without
    GPUs) through `hetps tune`."""
    rc, text = _cli(tmp_path, "--budget", "cpu=4,gpu=1", "--prices", "cpu=0.048,gpu=2.50", "--target", "1e12")
    assert rc == 1 and "reaching 1,000,000,000,000 examples/s" in text and "fastest predicted" in text
    rc, text = _cli(tmp_path, "--budget", "cpu=4,gpu=1", "--target", "100")
    assert rc == 2 and "need --prices" in text
    rc, text = _cli(tmp_path, "--cluster", "nodes=2,cores=8,gpus=1,bandwidth=10Gbit,latency=50us")
    assert rc == 0, text
    assert "PREDICTION ON PAPER for 2 node(s) x (8 cores, 1 GPU(s))" in text and "50% of messages" in text
    rc, text = _cli(tmp_path, "--cluster", "nodes=2,cores=8,gpus=0", "--prices", "cpu=0.05")
    assert rc == 0 and "no GPUs: the plan's GPU trainer types run on CPU cores" in text, text
    assert "0 GPU(s) x $0" in text  # the gpu trainer type runs on cores: no GPU paid for
