"""Generate the Python stubs of every .proto under protos/: `python -m protos.generate [--check]`.

protoc runs with the repository root as its include path, so the stubs import one another as
`protos.pdserve.v1...`. Each foo.proto gets foo_pb2.py, foo_pb2.pyi and foo_pb2_grpc.py beside it.
`--check` generates into a temporary folder instead and exits 1, naming the files, when the
committed stubs differ from what the .proto files give (or when a stub has no .proto any more).
The output depends on the grpcio-tools version: regenerate with the one the project pins.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS_DIR = ROOT / "protos"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """Returns: the .proto files under protos/, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for p in PROTOS_DIR.rglob("*.proto"))


def expected_stubs(protos: list[Path]) -> list[Path]:
    """Returns: the stub paths (relative to the repository root) that `protos` generate."""
    return [p.with_name(p.stem + suffix) for p in protos for suffix in STUB_SUFFIXES]


def generate(out_dir: Path, protos: list[Path]) -> None:
    """Run protoc on `protos` (relative to the root), writing all three kinds of stub under `out_dir`."""
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *(str(ROOT / p) for p in protos)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(map(str, protos))} (see its message above)")


def stale_stubs(protos: list[Path]) -> list[str]:
    """Returns: the committed stubs that differ from freshly generated ones, are missing, or are orphans."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), protos)
        expected = expected_stubs(protos)
        stale = [str(p) for p in expected
                 if not (ROOT / p).is_file() or (ROOT / p).read_bytes() != (Path(tmp) / p).read_bytes()]
    committed = {p.relative_to(ROOT) for suffix in STUB_SUFFIXES for p in PROTOS_DIR.rglob("*" + suffix)}
    orphans = [f"{p} (no .proto)" for p in sorted(committed - set(expected))]
    return stale + orphans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="generate into a temporary folder; exit 1 if the committed stubs are stale")
    args = parser.parse_args(argv)
    protos = proto_files()
    if not protos:
        print(f"no .proto files under {PROTOS_DIR}", file=sys.stderr)
        return 1
    if args.check:
        stale = stale_stubs(protos)
        if stale:
            print("stale generated stubs (run `python -m protos.generate`):\n  " + "\n  ".join(stale),
                  file=sys.stderr)
            return 1
        print(f"stubs up to date ({len(protos)} .proto files)")
        return 0
    generate(ROOT, protos)
    print("generated:\n  " + "\n  ".join(map(str, expected_stubs(protos))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
