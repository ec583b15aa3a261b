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


# (include root, sources below it, output subfolder). The path protoc records for a file is
# relative to its include root and must equal the reference's where one exists: AVP's is
# "avp.proto", so the reference `avp` package and ours can share one descriptor pool.
UNITS = (
    (PROTO_DIR, PROTO_DIR / "evergreen", ""),
    (PROTO_DIR / "avp", PROTO_DIR / "avp", "avp"),
    (PROTO_DIR / "vertexai", PROTO_DIR / "vertexai", "vertexai"),
    (PROTO_DIR / "vllm", PROTO_DIR / "vllm", "vllm"),
)


def generate(out_dir: Path) -> list[Path]:
    """Generate every proto under ``proto/`` into ``out_dir``; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    written: list[Path] = []
    for root, folder, subfolder in UNITS:
        target = out_dir / subfolder
        target.mkdir(parents=True, exist_ok=True)
        sources = [str(p.relative_to(root)) for p in sorted(folder.rglob("*.proto"))]
        args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={target}", f"--pyi_out={target}", *sources]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {sources}")
        written += sorted(target.glob("**/*_pb2.py*"))
    top_packages = sorted({p.relative_to(out_dir).parts[0] for p in written})
    pattern = re.compile(rf"^(from|import) ({'|'.join(map(re.escape, top_packages))})(\.|\s)", re.MULTILINE)
    for path in written:
        path.write_text(pattern.sub(rf"\1 {PACKAGE}.\2\3", path.read_text()))
        for package_dir in path.relative_to(out_dir).parents:
            init = out_dir / package_dir / "__init__.py"
            if not init.exists():
                init.write_text("")
    return sorted(set(written))


def main() -> None:
    files = generate(OUT_DIR)
    print(f"generated {len(files)} files into {OUT_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
