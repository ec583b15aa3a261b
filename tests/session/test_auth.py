"""authorize runs before the session starts: refusals are UNAUTHENTICATED / PERMISSION_DENIED with no
handler run; the principal reaches handlers; the token file is compared in constant time and re-read."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import trio

from evergreen_trio import Server, SessionAbortedError, connect, text
from evergreen_trio.dag import StatusCode
from evergreen_trio.nursery_session import ActionContext
from evergreen_trio.serving.auth import Peer, PermissionDeniedError, TokenFileAuthorizer, UnauthenticatedError
from evergreen_trio.testing.subprocess_server import serve_command


class Recorder:
    """A server whose WHOAMI action writes the principal back; ``runs`` counts handler starts."""

    def __init__(self, **options: object) -> None:
        self.runs = 0
        self.server = Server(**options)  # type: ignore[arg-type]

        @self.server.action("WHOAMI", inputs=["input"], outputs=["output"])
        async def whoami(ctx: ActionContext) -> None:
            self.runs += 1
            await ctx.output("output").write(ctx.principal or "<nobody>", last=True)


async def whoami(port: int, metadata: Mapping[str, str] | None = None) -> str:
    async with connect(f"127.0.0.1:{port}", metadata=metadata, timeout=30) as session:
        call = await session.run("WHOAMI", {"input": text("?")}, ["output"])
        return await call["output"].read_text()


async def refused(port: int, metadata: Mapping[str, str] | None = None) -> SessionAbortedError:
    with pytest.raises(SessionAbortedError) as aborted:
        await whoami(port, metadata)
    return aborted.value


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# agents allowed in\nalpha-token-1\n\n  beta-token-2   # the batch runner\n")
    return path


async def test_token_file_accepts_its_tokens_and_refuses_the_rest(tokens: Path, nursery: trio.Nursery) -> None:
    recorder = Recorder(authorize=TokenFileAuthorizer(tokens))
    port = await nursery.start(recorder.server.serve, "127.0.0.1", 0)

    principal = await whoami(port, {"authorization": "Bearer beta-token-2"})
    assert principal.startswith("token:") and len(principal) == len("token:") + 12
    assert principal != await whoami(port, {"authorization": "Bearer alpha-token-1"})
    assert recorder.runs == 2

    for metadata in (None, {"authorization": "Bearer wrong"}, {"authorization": "Basic alpha-token-1"},
                     {"authorization": "Bearer # agents allowed in"}, {"authorization": "Bearer "}):
        aborted = await refused(port, metadata)
        assert aborted.code is StatusCode.UNAUTHENTICATED, metadata
    assert recorder.runs == 2  # no handler ran for a refused session
    aborts = recorder.server.metrics.registry.get_sample_value
    assert aborts("evergreen_session_aborts_total", {"reason": "unauthenticated"}) == 5


async def test_async_authorizer_permission_denied_and_its_bugs(nursery: trio.Nursery) -> None:
    async def authorize(metadata: Mapping[str, str], peer: Peer) -> str:
        await trio.lowlevel.checkpoint()
        role = metadata.get("x-role")
        if role == "guest":
            raise PermissionDeniedError("guests may not open sessions")
        if role == "crash":
            raise RuntimeError("authorizer bug")
        if role is None:
            raise UnauthenticatedError("no x-role")
        return f"{role}@{peer.address.rsplit(':', 1)[0]}"

    recorder = Recorder(authorize=authorize)
    port = await nursery.start(recorder.server.serve, "127.0.0.1", 0)
    assert await whoami(port, {"x-role": "admin"}) == "admin@127.0.0.1"
    assert (await refused(port, {"x-role": "guest"})).code is StatusCode.PERMISSION_DENIED
    assert (await refused(port, {})).code is StatusCode.UNAUTHENTICATED
    crashed = await refused(port, {"x-role": "crash"})
    assert crashed.code is StatusCode.INTERNAL and "authorizer bug" not in crashed.message
    assert recorder.runs == 1


async def test_without_authorize_the_principal_is_none(nursery: trio.Nursery) -> None:
    recorder = Recorder()
    port = await nursery.start(recorder.server.serve, "127.0.0.1", 0)
    assert await whoami(port) == "<nobody>"


async def test_token_file_changes_are_picked_up_within_seconds(tokens: Path, nursery: trio.Nursery) -> None:
    recorder = Recorder(authorize=TokenFileAuthorizer(tokens))
    port = await nursery.start(recorder.server.serve, "127.0.0.1", 0)
    old, new = {"authorization": "Bearer alpha-token-1"}, {"authorization": "Bearer gamma-token-3"}
    await whoami(port, old)
    await trio.Path(tokens).write_text("gamma-token-3\n")
    os.utime(tokens, ns=(0, 10**18))  # a new mtime even on a coarse-clock file system
    with trio.fail_after(10):  # "within a few seconds"; a hang guard, not a timing claim
        while True:
            try:
                await whoami(port, new)
                break
            except SessionAbortedError as aborted:
                assert aborted.code is StatusCode.UNAUTHENTICATED
                await trio.sleep(0.2)
    assert (await refused(port, old)).code is StatusCode.UNAUTHENTICATED

    await trio.Path(tokens).unlink()  # a vanished file revokes everything (fail closed)
    with trio.fail_after(10):
        while True:
            try:
                await whoami(port, new)
                await trio.sleep(0.2)
            except SessionAbortedError as aborted:
                assert aborted.code is StatusCode.UNAUTHENTICATED
                break


def test_token_file_compares_every_token(tokens: Path) -> None:
    authorizer = TokenFileAuthorizer(tokens)
    peer = Peer("127.0.0.1:1")
    assert authorizer({"authorization": "bearer alpha-token-1"}, peer).startswith("token:")  # scheme: any case
    with pytest.raises(UnauthenticatedError, match=r"127\.0\.0\.1:1"):
        authorizer({"authorization": "Bearer alpha-token-"}, peer)  # a prefix is not the token
    with pytest.raises(FileNotFoundError):
        TokenFileAuthorizer(tokens.parent / "missing")


async def test_serve_with_auth_token_file_as_a_user_types_it(tokens: Path) -> None:
    async with serve_command("--auth-token-file", str(tokens)) as line:
        address = line.split()[-1]
        async with connect(address, metadata={"authorization": "Bearer alpha-token-1"}, timeout=30) as session:
            call = await session.run("ECHO", {"input": text("let in")}, ["output"])
            assert await call["output"].read_text() == "let in"
        with pytest.raises(SessionAbortedError) as aborted:
            async with connect(address, timeout=30) as session:
                await session.run("ECHO", {"input": text("kept out")}, ["output"])
        assert aborted.value.code is StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--auth-token-file", "/nonexistent/tokens"], "--auth-token-file"),
        (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "--tls-cert"),
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--max-sessions", "0"], "--max-sessions"),
    ],
)
def test_serve_refuses_bad_security_options_in_one_line(args: list[str], named: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr
