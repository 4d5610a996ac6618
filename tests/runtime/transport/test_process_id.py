"""A process's name ("cpu:0", "ps:1") is built and parsed in one place: `ProcessId`."""

from __future__ import annotations

import pytest

from runtime.transport.process_id import EVALUATOR, SERVER, ProcessId, by_kind, process_names


@pytest.mark.parametrize("name", ["cpu:0", "gpu:1", "ps:12", "eval:3", "cpu_big:7"])
def test_a_name_round_trips(name):
    pid = ProcessId.parse(name)
    assert str(pid) == name and ProcessId.parse(str(pid)) == pid
    assert ProcessId(pid.kind, pid.index) == pid and hash(pid) == hash(ProcessId(pid.kind, pid.index))


def test_the_fields_and_the_kinds_of_the_run():
    assert ProcessId.parse("gpu:3") == ProcessId("gpu", 3)
    assert ProcessId.server(2) == ProcessId(SERVER, 2) and str(ProcessId.server(2)) == "ps:2"
    assert ProcessId.server(0).is_server and not ProcessId("cpu", 0).is_server
    assert process_names("cpu", 3) == ["cpu:0", "cpu:1", "cpu:2"] and process_names(EVALUATOR, 0) == []
    assert sorted([ProcessId("gpu", 0), ProcessId("cpu", 10), ProcessId("cpu", 2)]) == [
        ProcessId("cpu", 2),
        ProcessId("cpu", 10),
        ProcessId("gpu", 0),
    ]


def test_an_id_is_frozen():
    pid = ProcessId("cpu", 0)
    with pytest.raises(AttributeError):
        pid.index = 1


@pytest.mark.parametrize(
    "name", ["cpu", "cpu:", ":0", "cpu:x", "cpu:0:1", "cpu:-1", "cpu:01", "cpu: 1", "cpu:１", "driver", ""]
)
def test_a_malformed_name_is_refused_with_what_a_name_looks_like(name):
    with pytest.raises(ValueError, match=r"is not a process name: expected 'kind:index' such as 'cpu:0'"):
        ProcessId.parse(name)
    assert ProcessId.maybe(name) is None


def test_a_name_that_is_not_a_string_is_refused():
    with pytest.raises(ValueError, match="None is not a process name"):
        ProcessId.parse(None)


@pytest.mark.parametrize(
    ("kind", "index", "what"),
    [("", 0, "kind"), ("a:b", 0, "kind"), (3, 0, "kind"), ("cpu", -1, "index"), ("cpu", "0", "index")],
)
def test_a_malformed_id_is_refused(kind, index, what):
    with pytest.raises(ValueError, match=f"a process {what} must be"):
        ProcessId(kind, index)


def test_by_kind_orders_values_by_index_and_refuses_gaps():
    eps = {"gpu:1": "g1", "cpu:0": "c0", "gpu:0": "g0"}
    assert by_kind(eps) == {"gpu": ["g0", "g1"], "cpu": ["c0"]}
    with pytest.raises(ValueError, match=r"kind 'gpu' have indices \[0, 2\]"):
        by_kind({"gpu:0": "a", "gpu:2": "b"})
    with pytest.raises(ValueError, match="'driver' is not a process name"):
        by_kind({"driver": "a"})
