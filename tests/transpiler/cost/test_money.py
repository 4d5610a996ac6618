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
