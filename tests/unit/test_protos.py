"""The committed stubs are what `python -m protos.generate` produces, and they import."""

import importlib
import pathlib

import pytest

from protos import generate

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_stubs_are_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    generate.generate(tmp_path)
    stale = []
    for name in generate.generated_names():
        fresh = (tmp_path / generate.PROTO_DIR / name).read_bytes()
        committed_path = ROOT / generate.PROTO_DIR / name
        if not committed_path.exists() or committed_path.read_bytes() != fresh:
            stale.append(name)
    assert stale == [], f"stale stubs {stale}: run `.venv/bin/python -m protos.generate`"


def test_stubs_import_and_name_the_services():
    gen = importlib.import_module("protos.pagedserve.v1.generation_pb2")
    ex = importlib.import_module("protos.pagedserve.v1.executor_pb2")
    assert set(gen.DESCRIPTOR.services_by_name) == {"Generation"}
    assert set(ex.DESCRIPTOR.services_by_name) == {"Executor"}
    assert gen.FinishReason.Name(2) == "FINISH_REASON_STOP"
    assert [m.name for m in ex.DESCRIPTOR.services_by_name["Executor"].methods] == [
        "Describe", "InitCache", "Step", "StepStream", "Reset"
    ]
