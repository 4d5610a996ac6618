"""runtime.exec.device: the one home of the device-kind rule and of host copies."""

from __future__ import annotations

import numpy as np
import pytest

from ops_registry import SparseRows
from runtime.exec.device import array_module, to_host
from transpiler.config import kind_of


class FakeDeviceArray:
    """Stands in for a cupy array: has `__cuda_array_interface__`, copies to host with `get()`."""

    __cuda_array_interface__ = {}

    def __init__(self, host: np.ndarray) -> None:
        self.host = host

    def get(self) -> np.ndarray:
        return self.host.copy()


def test_to_host():
    a = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(to_host(FakeDeviceArray(a)), a)
    assert isinstance(to_host([1, 2]), np.ndarray) and to_host([1, 2]).tolist() == [1, 2]
    rows = SparseRows(np.array([1]), np.ones((1, 2)), 5)
    assert to_host(rows) is rows


@pytest.mark.parametrize(
    "trainer_type, device_map, kind",
    [
        ("cpu", None, "cpu"),
        ("gpu", None, "gpu"),
        ("gpu_big", None, "gpu"),
        ("tower", None, "cpu"),
        ("tower", {"tower": "gpu"}, "gpu"),
        ("gpu", {"gpu": "cpu"}, "cpu"),
    ],
)
def test_device_kind_rule(trainer_type, device_map, kind):
    assert kind_of(trainer_type, device_map) == kind


def test_bad_device_kind_is_named():
    with pytest.raises(ValueError, match=r"device_map\['x'\] = 'tpu'"):
        kind_of("x", {"x": "tpu"})
    with pytest.raises(ValueError, match=r"device_map\['x'\] = 'tpu'"):
        array_module("x", {"x": "tpu"})


def test_cpu_type_computes_with_numpy():
    xp, what = array_module("tower", {"tower": "cpu"})
    assert xp is np and what.startswith("cpu")
