"""The committed generated code is exactly what grpcio-tools makes of protos/ today."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_generated_code_is_current(tmp_path: Path):
    generate(tmp_path)
    generated = sorted((tmp_path / "extproc" / "envoy" / "proto").glob("*_pb2*"))
    assert [p.name for p in generated] == [
        f"{name}_pb2{suffix}" for name in ("ext_proc",) for suffix in (".py", ".pyi", "_grpc.py")
    ]
    for fresh in generated:
        committed = ROOT / "extproc" / "envoy" / "proto" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run python protos/generate.py"


def test_service_path_is_envoys():
    from extproc.envoy.proto import ext_proc_pb2

    service = ext_proc_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert service.methods_by_name["Process"].client_streaming
