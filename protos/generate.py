"""Regenerate the committed Python stubs from the .proto sources.

    .venv/bin/python -m protos.generate            # writes protos/pagedserve/v1/*_pb2*.py(i)
    .venv/bin/python -m protos.generate --out DIR  # writes the same tree under DIR (the staleness test)

protoc runs with the repository root as include path, so the generated modules import each other as
`protos.pagedserve.v1.*`, importable from the root. Needs grpcio-tools (the `dev` extra); the
generated stubs themselves need only grpcio and protobuf.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = pathlib.Path("protos/pagedserve/v1")
PROTO_FILES = ("generation.proto", "executor.proto", "frontend.proto")


def generated_names() -> list[str]:
    names = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    return names


def generate(out_dir: pathlib.Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / PROTO_DIR / p) for p in PROTO_FILES),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="root of the output tree")
    args = parser.parse_args(argv)
    generate(args.out.resolve())
    for name in generated_names():
        print(args.out / PROTO_DIR / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
