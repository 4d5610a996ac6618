"""What a user sees for bad input: the file, feed or batch at fault and what is wrong with it, not an
internal error from deep inside (a table's gradient, a zip reader, a JSON parser)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ops_registry.loss import check_binary_labels
from runtime import TrainingError, train
from runtime.data import SyntheticCTR
from runtime.data.sources import check_values
from runtime.engines import LocalEngine
from transpiler import builder as nn
from transpiler import transpile
from transpiler.errors import PlanError
from transpiler.models import wide_deep
from transpiler.plan import Plan


def _train_on(batch: dict) -> None:
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1))
    train(model.main, [batch], epochs=1, engine=LocalEngine(), allow_emulation=True, progress=False)


def _batch() -> dict:
    return {k: v.copy() for k, v in SyntheticCTR(vocab=1000).batch(0, 64).items()}


def test_a_plan_json_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "p"
    transpile(wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1)).main).save(path)
    (path / "plan.json").write_text('{"trainer_types": [')
    with pytest.raises(PlanError, match=r"plan\.json is not valid JSON"):
        Plan.load(path)
    (path / "plan.json").write_text(json.dumps({"trainer_types": ["cpu"]}))
    (path / "programs" / "cpu.json").write_text("not json")
    with pytest.raises(PlanError, match=r"cpu\.json is not valid JSON"):
        Plan.load(path)


def test_nan_in_a_dense_feed_names_the_feed_and_the_batch():
    batch = _batch()
    batch["dense"][7, 2] = np.nan
    with pytest.raises(TrainingError, match=r"feed 'dense' in the batch of step 0 holds NaN or Inf.*row 7"):
        _train_on(batch)


def test_a_uint64_id_beyond_int64_is_reported_unsigned():
    batch = _batch()
    batch["sparse"] = batch["sparse"].astype(np.uint64)
    batch["sparse"][3, 0] = np.uint64(2**64 - 1)
    with pytest.raises(TrainingError, match=r"feed 'sparse' .*above 2\^63 - 1.*\[18446744073709551615\]"):
        _train_on(batch)


def test_a_label_outside_0_1_for_a_bce_loss_is_refused_naming_the_feed():
    batch = _batch()
    batch["label"][5] = 2.0
    with pytest.raises(
        TrainingError, match=r"Label=label:.*Label holds 1 values outside \[0, 1\] \(e\.g\. \[2\.0\]\)"
    ):
        _train_on(batch)


def test_the_checks_pass_good_values_and_soft_labels():
    batch = _batch()
    check_values(batch, sorted(batch), 0, 64, 0)
    check_values({"ids": np.array([1, 2**63 - 1], np.uint64)}, ["ids"], 0, 2, 0)
    check_binary_labels(np.array([0.0, 0.25, 1.0]), "bce_loss", "Label")
    batch["dense"][70 % 64, 0] = np.inf
    check_values(batch, ["dense"], 7, 64, 3)  # rows outside [lo, hi) are another reader's
    with pytest.raises(ValueError, match=r"feed 'dense' in the batch of step 3 .*row 6"):
        check_values(batch, ["dense"], 0, 64, 3)
    with pytest.raises(
        ValueError, match=r"bce_loss: Label holds 1 values outside \[0, 1\] \(e\.g\. \[nan\]\)"
    ):
        check_binary_labels(np.array([0.0, np.nan]), "bce_loss", "Label")
