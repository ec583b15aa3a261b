"""Regenerate `evergreen_trio/_proto` from `proto/` with grpcio-tools' protoc.

protoc writes absolute imports named after the .proto paths (``from evergreen.v2 import ...``);
they are rewritten to ``evergreen_trio._proto.`` so the generated code imports as a subpackage.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent
PACKAGE = "evergreen_trio._proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Generate every proto under ``proto/`` into ``out_dir``; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += sources
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {sources}")
    top_packages = sorted({Path(s).parts[0] for s in sources})
    pattern = re.compile(rf"^(from|import) ({'|'.join(map(re.escape, top_packages))})(\.|\s)", re.MULTILINE)
    written = []
    for path in sorted(out_dir.rglob("*_pb2.py*")):
        text = path.read_text()
        path.write_text(pattern.sub(rf"\1 {PACKAGE}.\2\3", text))
        written.append(path)
    for path in written:
        for package_dir in path.relative_to(out_dir).parents:
            init = out_dir / package_dir / "__init__.py"
            if not init.exists():
                init.write_text("")
    return written


def main() -> None:
    files = generate(OUT_DIR)
    print(f"generated {len(files)} files into {OUT_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
