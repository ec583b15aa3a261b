"""AVP agents over HTTP against the reference's: its ``AVPClient`` against our server, our client against its
``create_app`` under a real ASGI server in a subprocess (HTTP/1.1 and HTTP/2), the token, and bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import avp as reference
import httpx
import numpy as np
import pytest
import trio
from avp.transport import AVPClient

from evergreen_trio.avp import AVPMetadata, DataType, PayloadType, encode, pack_kv
from evergreen_trio.avp.client import open_avp_client
from evergreen_trio.avp.errors import AVPTransportError
from evergreen_trio.avp.fallback import JSONMessage
from evergreen_trio.avp.handshake import HelloMessage, ModelIdentity
from evergreen_trio.avp.message import CommunicationMode
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, serve_avp

HERE = Path(__file__).parent
LLAMA = ModelIdentity(model_family="llama", model_id="llama-1b", model_hash="a" * 64, hidden_dim=64, num_layers=2,
                      num_kv_heads=2, head_dim=8, tokenizer_hash="t" * 64)
QWEN = ModelIdentity(model_family="qwen2", model_id="qwen-1b", model_hash="b" * 64, hidden_dim=96, num_layers=3,
                     tokenizer_hash="t" * 64)
TOKEN = "s3cret-token"


async def _server(nursery: trio.Nursery, **options: Any) -> str:
    port = await nursery.start(serve_avp, AVPApp(AVPServerOptions(**options)), "127.0.0.1", 0)
    return f"http://127.0.0.1:{port}"


def _reference_identity(identity: ModelIdentity) -> Any:
    return reference.ModelIdentity(**{k: getattr(identity, k) for k in identity.__dataclass_fields__})


# ------------------------------------------------------------ the reference's client, our server


async def test_reference_client_against_our_server(nursery: trio.Nursery) -> None:
    url = await _server(nursery, token=TOKEN.encode(), hello=HelloMessage(agent_id="ours", identity=QWEN))

    def talk() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with AVPClient(url, agent_id="theirs", model_identity=_reference_identity(LLAMA), token=TOKEN) as client:
            info = client.handshake()
            out["session"] = (info.session_id, info.mode.name, info.resolution_path, info.avp_map_id)
            hidden = np.arange(2 * 64, dtype="<f4")
            meta = reference.AVPMetadata(session_id=info.session_id, payload_type=reference.PayloadType.HIDDEN_STATE,
                                         dtype=reference.DataType.FLOAT32, tensor_shape=(2, 64))
            out["hidden"] = client.transmit(hidden.tobytes(), meta).json()
            out["compressed"] = client.transmit(hidden.tobytes(), meta, reference.CompressionLevel.BALANCED).json()
            layers = [(np.ones((1, 2, 5, 8), "<f2"), np.zeros((1, 2, 5, 8), "<f2")) for _ in range(3)]
            kv = b"".join(bytes(memoryview(part).cast("B")) if isinstance(part, bytes) else part.tobytes()
                          for part in pack_kv(layers))
            kv_meta = reference.AVPMetadata(payload_type=reference.PayloadType.KV_CACHE,
                                            dtype=reference.DataType.FLOAT16)
            out["kv"] = client.transmit(kv, kv_meta).json()
            out["text"] = client.send_text(reference.JSONMessage(session_id=info.session_id, content="hello")).json()
            bad = client._client.post("/avp/v2/transmit", content=b"AV\x01\x00garbage", headers=client._headers())
            out["bad"] = (bad.status_code, bad.json())
            out["health"] = client._client.get("/health").json()
        with AVPClient(url, agent_id="intruder", model_identity=_reference_identity(LLAMA), token="wrong") as client:
            try:
                client.transmit(b"", reference.AVPMetadata())
            except reference.TransportError as error:
                out["unauthorised"] = error.status_code
        return out

    out = await trio.to_thread.run_sync(talk)
    session_id, mode, path, avp_map_id = out["session"]
    assert len(session_id) == 32 and (mode, path, avp_map_id) == ("LATENT", "shared_tokenizer", "vocab:" + "t" * 16)
    assert out["hidden"] == {"success": True, "payload_type": "HIDDEN_STATE", "dtype": "FLOAT32", "shape": [2, 64],
                             "bytes": 512}
    assert out["compressed"] == out["hidden"]
    assert out["kv"] == {"success": True, "payload_type": "KV_CACHE", "dtype": "FLOAT16", "shape": [3, 2, 2, 5, 8],
                         "bytes": 17 + 3 * 2 * 2 * 5 * 8 * 2}
    assert out["text"] == {"success": True, "session_id": session_id, "chars": 5}
    status, body = out["bad"]
    assert status == 400 and body["success"] is False and body["message"].startswith("bad AVP message: ")
    assert "\n" not in body["message"]
    assert out["health"] == {"status": "ok"}
    assert out["unauthorised"] == 401


# ------------------------------------------------------------ our client, the reference's app


@pytest.fixture(scope="module")
def reference_agent() -> Iterator[str]:
    process = subprocess.Popen([sys.executable, str(HERE / "reference_agent.py")], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=30)


async def test_our_client_against_the_reference_app(reference_agent: str) -> None:
    async with open_avp_client(reference_agent, agent_id="ours", identity=LLAMA) as client:
        assert await client.health() == {"status": "ok"}
        session = await client.handshake()  # its default handshake echoes our identity back
        assert session.mode is CommunicationMode.LATENT and session.path == "hash_match"
        hidden = np.linspace(0, 1, 64, dtype="<f4").reshape(1, 64)
        meta = AVPMetadata(session_id=session.session_id, tensor_shape=(1, 64))
        for compression in (None, "fast"):
            answer = await client.transmit(hidden, meta, compression=compression)
            assert answer == {"success": True, "payload_type": "HIDDEN_STATE", "dtype": "FLOAT32", "shape": [1, 64],
                              "bytes": 256, "session_id": session.session_id, "sum": pytest.approx(float(hidden.sum()))}
        layers = [(np.ones((1, 2, 4, 8), "<f2"), np.ones((1, 2, 4, 8), "<f2"))] * 2
        kv = await client.transmit(pack_kv(layers), AVPMetadata(payload_type=PayloadType.KV_CACHE,
                                                                dtype=DataType.FLOAT16))
        assert (kv["payload_type"], kv["bytes"]) == ("KV_CACHE", 17 + 2 * 2 * 2 * 4 * 8 * 2)
        text = await client.send_text(JSONMessage(session_id=session.session_id, content="bonjour"))
        assert text == {"success": True, "content": "bonjour", "session_id": session.session_id}
        with pytest.raises(AVPTransportError, match="HTTP 400") as caught:
            await client.send_raw(b"not an AVP message")
        assert caught.value.status_code == 400


# ------------------------------------------------------------ our client, our server, both HTTP versions


@pytest.fixture
async def ours(nursery: trio.Nursery) -> AsyncIterator[str]:
    yield await _server(nursery, token=TOKEN.encode(), hello=HelloMessage(agent_id="ours", identity=QWEN))


async def test_our_client_and_server(ours: str) -> None:
    async with open_avp_client(ours, agent_id="me", identity=LLAMA, token=TOKEN) as client:
        session = await client.handshake()
        assert (session.mode, session.path, session.ttl_s) == (CommunicationMode.LATENT, "shared_tokenizer", 3600.0)
        answer = await client.transmit(np.zeros((3, 4), "<f2"), AVPMetadata(dtype=DataType.FLOAT16,
                                                                           tensor_shape=(3, 4)))
        assert answer == {"success": True, "payload_type": "HIDDEN_STATE", "dtype": "FLOAT16", "shape": [3, 4],
                          "bytes": 24}
        response = await client._client.get("/health")
        assert response.http_version == "HTTP/1.1"
        assert response.headers["avp-version"] == "0.4"


async def test_our_client_speaks_http2_to_the_reference_app(reference_agent: str) -> None:
    # Our server is HTTP/1.1 only (docs/security.md: h2c was dropped); the client's h2c is tried on hypercorn.
    async with open_avp_client(reference_agent, agent_id="ours", identity=LLAMA, http2=True) as client:
        assert await client.health() == {"status": "ok"}
        response = await client._client.get("/health")
        assert response.http_version == "HTTP/2"


async def answering(nursery: trio.Nursery, body: bytes, headers: bytes = b"",
                    requests: list[bytes] | None = None) -> str:
    """A server answering every request with ``body`` (JSON, HTTP 200, with ``headers`` too); its base
    URL. Each request's head, lowercased, goes to ``requests``."""

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                request += await stream.receive_some(65536)
            if requests is not None:
                requests.append(request.lower())
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s"
                                  b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (headers, len(body), body))

    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    nursery.start_soon(trio.serve_listeners, answer, [listener])
    return f"http://127.0.0.1:{listener.socket.getsockname()[1]}"


async def test_our_client_refuses_an_answer_nested_too_deep(nursery: trio.Nursery) -> None:
    """An answer of 200 000 nested arrays (under the answer cap) is an AVPTransportError, not a RecursionError."""
    async with open_avp_client(await answering(nursery, b"[" * 200_000), timeout_s=10) as client:
        with pytest.raises(AVPTransportError, match="expected a JSON object") as caught:
            await client.health()
    assert caught.value.status_code == 200


NOT_A_TTL = [b"Infinity", b"-Infinity", b"NaN", b"-5", b"0", b"1e999", b"9" * 400, b'"1h"', b"true"]


@pytest.mark.parametrize("ttl", NOT_A_TTL)
async def test_our_client_refuses_a_handshake_ttl_that_is_not_a_finite_positive_number(
    nursery: trio.Nursery, ttl: bytes
) -> None:
    """``ttl: Infinity`` was taken (a session that never expires); NaN and negatives were silently dropped."""
    url = await answering(nursery, b'{"identity": {}, "session_id": "s", "ttl": %s}' % ttl)
    async with open_avp_client(url, identity=LLAMA, timeout_s=10) as client:
        with pytest.raises(AVPTransportError, match=r"handshake: answer\.ttl: expected a finite number"):
            await client.handshake()
    assert client.session is None


async def test_our_client_keeps_a_finite_handshake_ttl(nursery: trio.Nursery) -> None:
    url = await answering(nursery, b'{"identity": {}, "session_id": "s", "ttl": 5.5}')
    async with open_avp_client(url, identity=LLAMA, timeout_s=10) as client:
        session = await client.handshake()
    assert (session.session_id, session.ttl_s) == ("s", 5.5)


async def test_our_client_refuses_a_compressed_answer(nursery: trio.Nursery) -> None:
    """It asks for identity and reads the answer raw: a gzip (or zstd) bomb is never inflated."""
    body = gzip.compress(b'{"status": "ok"}' + b" " * (8 << 20))
    requests: list[bytes] = []
    url = await answering(nursery, body, b"content-encoding: gzip\r\n", requests)
    async with open_avp_client(url, timeout_s=10) as client:
        with pytest.raises(AVPTransportError, match="expected no content-encoding \\(identity\\), got 'gzip'"):
            await client.health()
    assert b"\r\naccept-encoding: identity\r\n" in requests[0]


async def test_our_server_refuses_with_one_line(ours: str) -> None:
    good = encode(np.zeros(4, "<f4"), AVPMetadata(tensor_shape=(4,)))
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=ours) as http:
        cases = [
            ("POST", "/avp/v2/transmit", good, {}, 401, "expected Authorization: Bearer"),
            ("POST", "/avp/v2/transmit", good, {"authorization": "Bearer nope"}, 401, "expected Authorization"),
            ("POST", "/avp/v2/transmit", good[:-1], auth, 400, "bad AVP message: message: expected"),
            ("POST", "/avp/v2/transmit", good[:2] + b"\x02" + good[3:], auth, 400, "version: expected 1, got 2"),
            ("POST", "/avp/v2/handshake", b"[1]", auth, 400, "Invalid handshake: hello: expected a JSON object"),
            ("POST", "/avp/v2/text", b'{"content": 1}', auth, 400, "text message.content: expected a JSON str"),
            ("POST", "/avp/v2/text", b"x" * (2 << 20), auth, 413, "expected at most 1048576 bytes"),
            ("GET", "/avp/v2/transmit", None, auth, 405, "/avp/v2/transmit takes POST, got GET"),
            ("GET", "/nowhere", None, auth, 404, "no endpoint '/nowhere'"),
        ]
        for method, path, body, headers, status, message in cases:
            response = await http.request(method, path, content=body, headers=headers)
            document = response.json()
            assert (response.status_code, document["success"]) == (status, False), (path, document)
            assert message in document["message"] and "\n" not in document["message"]
        assert (await http.get("/health")).json() == {"status": "ok"}  # no token needed for liveness
        ok = await http.post("/avp/v2/transmit", content=good, headers=auth)
        assert ok.json()["success"] is True
        anonymous = (await http.post("/avp/v2/handshake", content=b"{}", headers=auth)).json()
        assert (anonymous["success"], anonymous["mode"], anonymous["agent_id"]) == (True, "JSON", "ours")


async def test_a_payload_of_partial_items_gets_a_400(ours: str) -> None:
    """A shapeless payload that is not a whole number of dtype items decodes (as the reference's does),
    but the built-in receiver cannot describe it: a one-line 400, not a 500."""
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=ours) as http:
        for body in (encode(b"abc", AVPMetadata()), encode(b"abc", AVPMetadata(), compression="fast")):
            response = await http.post("/avp/v2/transmit", content=body, headers=auth)
            assert response.status_code == 400, response.text
            assert response.json() == {"success": False, "message": "bad AVP message: payload of 3 bytes is not "
                                       "a whole number of FLOAT32 items"}


async def test_an_upload_refused_at_its_head_still_gets_the_answer(ours: str) -> None:
    """A client that reads nothing until its 8 MiB body is sent (as h11 and httpx do) gets the 413
    sent after the head: the server drops the unread body before closing, so no reset loses it."""
    body = b"x" * (8 << 20)
    head = (f"POST /avp/v2/text HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    stream = await trio.open_tcp_stream("127.0.0.1", int(ours.rsplit(":", 1)[1]))
    async with stream:
        await stream.send_all(head + body)
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]


async def test_an_answer_before_the_body_says_the_connection_closes(ours: str) -> None:
    """Refused before its body was read (401 here), a request's connection is closed after the answer,
    and the answer says so: a keep-alive client does not send its next request into a closing socket."""
    stream = await trio.open_tcp_stream("127.0.0.1", int(ours.rsplit(":", 1)[1]))
    async with stream:
        await stream.send_all(b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += await stream.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 401 ") and b"\r\nconnection: close\r\n" in answer.lower(), answer


async def test_a_body_past_the_limit_is_refused_before_it_is_read(nursery: trio.Nursery) -> None:
    from evergreen_trio.avp import AVPLimits

    url = await _server(nursery, limits=AVPLimits(max_payload_bytes=1024, max_metadata_bytes=256))
    async with httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/avp/v2/transmit", content=b"AV" + b"\0" * (64 << 20))
    assert response.status_code == 413 and "Content-Length" in response.json()["message"]


async def test_a_slow_body_times_out(nursery: trio.Nursery) -> None:
    url = await _server(nursery, body_timeout_s=0.3)
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nAV")
        reply = b""
        with trio.fail_after(30):  # the answer, then the connection closes (the body never ended)
            while chunk := await stream.receive_some(4096):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"expected it within 0.3s" in reply


def test_answers_are_json_documents() -> None:
    from evergreen_trio.avp.binding import answer

    assert json.loads(answer({"success": True})) == {"success": True}


async def test_requests_past_the_concurrency_cap_get_503(nursery: trio.Nursery) -> None:
    entered, release = trio.Event(), trio.Event()

    async def slow(message: Any) -> dict[str, Any]:
        entered.set()
        await release.wait()
        return {}

    app = AVPApp(AVPServerOptions(max_concurrent_requests=1), on_message=slow)
    port = await nursery.start(serve_avp, app, "127.0.0.1", 0)
    good = encode(np.zeros(4, "<f4"), AVPMetadata(tensor_shape=(4,)))
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

        async def post() -> None:
            statuses.append((await http.post("/avp/v2/transmit", content=good)).status_code)

        async with trio.open_nursery() as posts:
            posts.start_soon(post)
            await entered.wait()
            busy = await http.post("/avp/v2/transmit", content=good)
            assert busy.status_code == 503 and "max_concurrent_requests" in busy.json()["message"]
            release.set()
    assert statuses == [200]


async def test_a_content_length_of_thousands_of_digits_is_a_400(nursery: trio.Nursery) -> None:
    """A length int() cannot read (over 4,300 digits) is the HTTP parser's 400, not a failed handler."""
    url = await _server(nursery)
    stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    async with stream:
        await stream.send_all(b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ncontent-length: "
                              + b"9" * 5000 + b"\r\n\r\n")
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
