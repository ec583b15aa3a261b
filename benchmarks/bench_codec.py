"""Protobuf codec cost per message: protobuf's upb classes (what we ship) against betterproto2.

The README explains why wire messages use the ``protobuf`` package rather than betterproto; this
area keeps that decision reproducible. Both libraries encode and decode the same messages: three
Evergreen ``SessionMessage``s (a streamed output token, a GENERATE request with its prompt, a
64 KiB leaf) and three ext_proc messages as the picker sees them (Envoy's request headers, a
completion request body, the picker's routing response). Each betterproto2 message is parsed from
the upb message's bytes and must encode back to an equal message, so both sides do the same work.

The betterproto2 classes are generated at run time into ``build/bench_codec/`` (gitignored), from
the very descriptors the upb classes use (this repository's ``proto/`` as compiled into
``evergreen_trio/_proto``, and the installed ``xds-protos`` for Envoy, which ships no .proto
files), with ``betterproto2-compiler`` run as a plugin of grpcio-tools' protoc. Nothing generated
is committed: a clean checkout with the ``bench`` extra reproduces it, and a new compiler or proto
regenerates it (the stamp is a hash of both).

Values are microseconds per call (median of alternating runs); the ratio is betterproto2 / upb.
upb parses into C structures and builds Python objects only for the fields read, so its decode
column is the cost of a message whose fields are then read selectively, as the server does.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import any_pb2, descriptor_pb2, struct_pb2
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message

from benchmarks._harness import Row, print_table, timed, write_results
from evergreen_trio._proto.evergreen.v2 import evergreen_pb2 as ev
from evergreen_trio.picker.processor import DESTINATION, LB_NAMESPACE

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "build" / "bench_codec"
PACKAGE = "betterproto2_gen"
PEER = f"betterproto2 {version('betterproto2')}"


@dataclass(frozen=True)
class Case:
    """One message measured on both libraries."""

    name: str
    message: Message
    package: str  # the proto package, which names the generated betterproto2 module


def _descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """Every file the measured messages need, dependencies first, as the upb pool holds them."""
    files: list[descriptor_pb2.FileDescriptorProto] = []
    seen: set[str] = set()

    def add(descriptor: FileDescriptor) -> None:
        if descriptor.name in seen:
            return
        seen.add(descriptor.name)
        for dependency in descriptor.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        descriptor.CopyToProto(proto)
        proto.source_code_info.SetInParent()  # the compiler reads comments from it; the pool keeps none
        files.append(proto)

    add(ev.DESCRIPTOR)
    add(ep.DESCRIPTOR)
    return descriptor_pb2.FileDescriptorSet(file=files)


def generate_betterproto(out_root: Path = GENERATED) -> Path:
    """Generate betterproto2 classes for the measured protos under ``out_root/betterproto2_gen``.

    Skipped when the stamp (hash of the descriptors and the compiler version) is unchanged.
    Returns the package folder. Raises ``subprocess.CalledProcessError`` when protoc or the
    plugin fails (its stderr is printed).
    """
    descriptors = _descriptor_set().SerializeToString()
    stamp = hashlib.sha256(descriptors + version("betterproto2-compiler").encode()).hexdigest()
    package = out_root / PACKAGE
    stamp_file = out_root / "stamp"
    if stamp_file.exists() and stamp_file.read_text() == stamp and (package / "__init__.py").exists():
        return package
    shutil.rmtree(out_root, ignore_errors=True)
    package.mkdir(parents=True)
    (out_root / "descriptors.pb").write_bytes(descriptors)
    bin_dir = Path(sys.executable).parent
    targets = [f.name for f in _descriptor_set().file if not f.name.startswith("google/protobuf/")]
    # The plugin formats its output with the `ruff` executable, so the venv's bin goes on PATH.
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"--descriptor_set_in={out_root / 'descriptors.pb'}",
         f"--plugin=protoc-gen-python_betterproto2={bin_dir / 'protoc-gen-python_betterproto2'}",
         f"--python_betterproto2_out={package}", *targets],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        done.check_returncode()
    stamp_file.write_text(stamp)
    return package


def _betterproto_module(package: str) -> ModuleType:
    if str(GENERATED) not in sys.path:
        sys.path.insert(0, str(GENERATED))
    return importlib.import_module(f"{PACKAGE}.{package}")


def _text_leaf(node_id: str, text: str, role: str) -> ev.NodeFragment:
    metadata = ev.ChunkMetadata(mimetype="text/plain", role=role)
    return ev.NodeFragment(id=node_id, chunk_fragment=ev.Chunk(metadata=metadata, data=text.encode()))


def _generate_request() -> ev.SessionMessage:
    config = any_pb2.Any()
    config.Pack(struct_pb2.Struct(fields={"max_tokens": struct_pb2.Value(number_value=256),
                                          "temperature": struct_pb2.Value(number_value=0.7)}))
    prompt = "Summarise the following support ticket in two sentences. " * 10
    return ev.SessionMessage(
        node_fragments=[
            _text_leaf("system", "You are a concise assistant.", "system"),
            _text_leaf("prompt", prompt, "user"),
            ev.NodeFragment(id="conversation", child_ids=["system", "prompt"]),
        ],
        actions=[ev.Action(
            name="GENERATE", inputs=[ev.NamedParameter(name="prompt", id="conversation")],
            outputs=[ev.NamedParameter(name="output", id="answer")], configs=[config],
            target_spec=ev.TargetSpec(id="model-a"),
        )],
    )


def _request_headers() -> ep.ProcessingRequest:
    headers = {
        ":authority": "gateway.example:8080", ":path": "/v1/completions", ":method": "POST", ":scheme": "http",
        "content-type": "application/json", "content-length": "1024", "accept": "*/*",
        "user-agent": "python-httpx/0.28.1", "x-forwarded-proto": "http",
        "x-request-id": "6f1c2f0e-2b8a-4c0e-9c57-1d2f4a8b9e31", "x-gateway-inference-objective": "chat",
        "x-envoy-expected-rq-timeout-ms": "15000",
    }
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                             for k, v in headers.items()])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map))


def _request_body() -> ep.ProcessingRequest:
    prompt = "Write a haiku about structured concurrency. " * 20
    body = f'{{"model":"meta-llama/Llama-3.1-8B","prompt":"{prompt}","max_tokens":128,"stream":true}}'
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body.encode(), end_of_stream=True))


def _routing_response() -> ep.ProcessingResponse:
    option = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    mutation = ep.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value),
                                                append_action=option)
                     for key, value in ((DESTINATION, b"10.0.3.17:8000"), ("content-length", b"1024"))],
        remove_headers=["x-gateway-inference-objective"],
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: "10.0.3.17:8000"}})
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)),
        dynamic_metadata=metadata,
    )


def cases() -> list[Case]:
    """The measured messages, Evergreen first."""
    token = ev.SessionMessage(node_fragments=[ev.NodeFragment(
        id="answer", seq=17, continued=True,
        chunk_fragment=ev.Chunk(metadata=ev.ChunkMetadata(mimetype="text/plain", role="assistant"), data=b" the"))])
    blob = ev.SessionMessage(node_fragments=[ev.NodeFragment(
        id="tensor", chunk_fragment=ev.Chunk(metadata=ev.ChunkMetadata(mimetype="application/octet-stream"),
                                             data=bytes(range(256)) * 256))])
    return [
        Case("evergreen: streamed output token", token, "evergreen.v2"),
        Case("evergreen: GENERATE request + prompt", _generate_request(), "evergreen.v2"),
        Case("evergreen: 64 KiB leaf", blob, "evergreen.v2"),
        Case("ext_proc: request headers", _request_headers(), "envoy.service.ext_proc.v3"),
        Case("ext_proc: request body (1 KiB JSON)", _request_body(), "envoy.service.ext_proc.v3"),
        Case("ext_proc: routing response", _routing_response(), "envoy.service.ext_proc.v3"),
    ]



def _pair(label: str, upb: Callable[[], object], peer: Callable[[], object], calls: int, runs: int,
          size: int) -> Row:
    """Median microseconds per call of each side; runs alternate so machine load hits both alike."""
    upb(), peer()
    measure_upb, measure_peer = partial(timed, upb, calls), partial(timed, peer, calls)
    samples = [(measure_upb(), measure_peer()) for _ in range(runs)]
    mine = statistics.median(s[0] for s in samples) * 1e6
    theirs = statistics.median(s[1] for s in samples) * 1e6
    return Row(label, mine, "us", peer=f"{PEER} {theirs:,.4g} us", ratio=theirs / mine,
               extra={"betterproto2_us": theirs, "bytes": size})


def measure_case(case: Case, calls: int, runs: int) -> list[Row]:
    """Encode and decode rows for one case. Raises ``AssertionError`` if the two disagree on it."""
    data = case.message.SerializeToString()
    upb_class = type(case.message)
    peer_class: Any = getattr(_betterproto_module(case.package), upb_class.__name__)
    peer_message = peer_class.parse(data)
    assert upb_class.FromString(bytes(peer_message)) == case.message, f"{case.name}: betterproto2 differs"
    return [
        _pair(f"encode {case.name}", case.message.SerializeToString, peer_message.__bytes__, calls, runs, len(data)),
        _pair(f"decode {case.name}", lambda: upb_class.FromString(data), lambda: peer_class.parse(data), calls,
              runs, len(data)),
    ]


def run(quick: bool = False) -> list[Row]:
    """Generate the betterproto2 classes, measure every case, print the table and write codec.json."""
    generate_betterproto()
    calls, runs = (50, 3) if quick else (2000, 9)
    rows = [row for case in cases() for row in measure_case(case, calls, runs)]
    print_table(f"Codec: upb us per message (peer: {PEER}; ratio = betterproto2 / upb)", rows)
    write_results("codec", rows, quick=quick, calls=calls, runs=runs,
                  libraries={"protobuf": version("protobuf"), "betterproto2": version("betterproto2"),
                             "betterproto2-compiler": version("betterproto2-compiler")})
    return rows
