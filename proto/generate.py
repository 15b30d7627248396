"""Regenerate the gRPC modules from proto/cluster.proto, or check that they are up to date.

    python -m proto.generate          # rewrite proto/cluster_pb2.py, _pb2_grpc.py, _pb2.pyi
    python -m proto.generate --check  # exit 1 if the committed files differ from the sources

protoc runs with the repository root as include path and `proto/cluster.proto` as the file, so
the generated service module imports its messages as `from proto import cluster_pb2`, the
package path, rather than protoc's bare top-level `import cluster_pb2`. The output depends on
the grpcio-tools version (it stamps its version into the files), so --check wants the version
the files were made with: the one the `test` extra pins (pyproject.toml). The mismatch message
names the version it ran with.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "proto/cluster.proto"
OUTPUTS = ("proto/cluster_pb2.py", "proto/cluster_pb2_grpc.py", "proto/cluster_pb2.pyi")
GRPC_IMPORT = "from proto import cluster_pb2 as"


def _fix(name: str, text: str) -> str:
    """Make the generated service module import its messages through the `proto` package."""
    if name.endswith("_grpc.py"):
        text = text.replace("\nimport cluster_pb2 as", f"\n{GRPC_IMPORT}")
        if GRPC_IMPORT not in text:
            raise RuntimeError(f"{name}: expected `{GRPC_IMPORT} ...` in the generated code")
    return text


def generate() -> dict[str, str]:
    """Run protoc in a scratch folder; return {relative path: text} of the generated files."""
    well_known = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as out:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(ROOT / SOURCE),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {SOURCE}")
        return {name: _fix(name, (Path(out) / name).read_text()) for name in OUTPUTS}


def check(generated: dict[str, str]) -> list[str]:
    """The unified diffs between the committed files and `generated` (empty: up to date)."""
    diffs = []
    for name, text in generated.items():
        path = ROOT / name
        committed = path.read_text() if path.exists() else ""
        if committed != text:
            lines = difflib.unified_diff(
                committed.splitlines(keepends=True),
                text.splitlines(keepends=True),
                f"{name} (committed)",
                f"{name} (generated)",
                n=1,
            )
            diffs.append("".join(lines))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = parser.parse_args(argv)
    generated = generate()
    if args.check:
        diffs = check(generated)
        if diffs:
            from grpc_tools import grpc_version

            sys.stdout.write("".join(diffs))
            print(
                f"stale generated files ({len(diffs)}); run `python -m proto.generate` "
                f"(grpcio-tools {grpc_version.VERSION} here)",
                file=sys.stderr,
            )
            return 1
        print("generated files are up to date")
        return 0
    for name, text in generated.items():
        (ROOT / name).write_text(text)
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
