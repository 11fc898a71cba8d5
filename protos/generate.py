"""Developer tool: compile protos/ into extproc/envoy/proto/ with grpcio-tools.

Run `python protos/generate.py` after editing a .proto. The generated modules are committed, so
installs need no compiler; tests/test_protos.py regenerates them into a temporary folder and fails
if the committed ones differ.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("extproc/envoy/proto/ext_proc.proto",)


def generate(out_dir: Path) -> None:
    """Write NAME_pb2.py, .pyi and _pb2_grpc.py for each of PROTOS under out_dir."""
    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
