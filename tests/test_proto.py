"""The committed generated code equals a fresh generation, and the wire facts of evergreen.v2 hold."""

from __future__ import annotations

from pathlib import Path

from evergreen_trio._proto import generate
from evergreen_trio._proto.evergreen.v2 import evergreen_pb2, evergreen_service_pb2


def test_committed_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    assert fresh
    for path in fresh:
        committed = generate.OUT_DIR / path.relative_to(tmp_path)
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto`"


def numbers(message: type) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_wire_field_numbers_match_the_spec() -> None:
    assert numbers(evergreen_pb2.NodeFragment) == {
        "id": 1, "seq": 2, "continued": 3, "child_ids": 4, "chunk_fragment": 5,
    }
    assert numbers(evergreen_pb2.Chunk) == {"metadata": 1, "ref": 3, "data": 10}
    assert numbers(evergreen_pb2.ChunkMetadata) == {
        "mimetype": 1, "role": 2, "original_file_name": 3, "capture_time": 6, "experimental": 100,
    }
    assert numbers(evergreen_pb2.Action) == {
        "name": 2, "inputs": 3, "outputs": 4, "configs": 5, "target_spec": 6,
    }
    assert numbers(evergreen_pb2.SessionMessage) == {"node_fragments": 1, "actions": 2}
    method = evergreen_service_pb2.DESCRIPTOR.services_by_name["EvergreenService"].methods_by_name["StartSession"]
    assert method.client_streaming and method.server_streaming
    assert method.full_name == "evergreen.v2.EvergreenService.StartSession"
