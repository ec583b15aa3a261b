"""Issue 22, item 15: one token-file format and loader for every command (``serve --auth-token-file``,
``avp serve --token-file``): one token per line, blank lines and ``#`` comments ignored, re-read when
the file changes. Both commands run as a user types them, over a real socket."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from evergreen_trio import SessionAbortedError, StatusCode, connect, text
from evergreen_trio.errors import ConfigurationError
from evergreen_trio.serving.auth import TokenFile
from evergreen_trio.testing.subprocess_server import serve_command

TOKENS = "# who may call us: one token per line\n\n  first-token  \n# second-token\nthird-token # ops\n\n"


def write(path: Path, content: str) -> None:
    """Replace the file as an editor does (a new inode), so a reload is seen whatever the mtime granularity."""
    fresh = path.with_suffix(".new")
    fresh.write_text(content)
    fresh.replace(path)


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    return path


def test_one_format_comments_and_blank_lines_are_not_tokens(tokens: Path) -> None:
    file = TokenFile(tokens, check_interval=0.001)
    accepted = [t for t in ("first-token", "third-token", "second-token", "# who may call us: one token per line",
                            "", "third-token # ops") if file.principal(t) is not None]
    assert accepted == ["first-token", "third-token"]
    write(tokens, "# nothing yet\n\n")
    with pytest.raises(ConfigurationError, match="expected at least one token"):
        TokenFile(tokens)


@pytest.fixture
def avp_serve(tokens: Path) -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "evergreen_trio.cli", "avp", "serve", "--port", "0", "--token-file", str(tokens)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ | {"PYTHONPATH": os.getcwd()})
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip().removeprefix("avp ")
    finally:
        process.terminate()
        process.wait(timeout=30)


def avp_status(url: str, token: str) -> int:
    headers = {"authorization": f"Bearer {token}"}
    return httpx.post(f"{url}/avp/v2/handshake", content=b"{}", headers=headers, timeout=30).status_code


async def test_avp_serve_token_file_comments_blank_lines_and_reload(avp_serve: str, tokens: Path) -> None:
    assert avp_status(avp_serve, "first-token") == 200  # not the comment on the first line
    assert avp_status(avp_serve, "third-token") == 200
    for refused in ("# who may call us: one token per line", "second-token", "first-token third-token"):
        assert avp_status(avp_serve, refused) == 401
    write(tokens, "# rotated\nnew-token\n")
    with trio.fail_after(10):  # re-read at most every second
        while avp_status(avp_serve, "new-token") != 200:  # noqa: ASYNC110 - the server has no reload event
            await trio.sleep(0.2)
    assert avp_status(avp_serve, "first-token") == 401


async def echo(address: str, token: str) -> StatusCode | None:
    """None when an ECHO session with ``token`` succeeds, else its abort code."""
    try:
        async with connect(address, metadata={"authorization": f"Bearer {token}"}, timeout=30) as session:
            call = await session.run("ECHO", {"input": text("hi")}, ["output"])
            assert await call["output"].read_text() == "hi"
    except SessionAbortedError as aborted:
        return aborted.code
    return None


async def test_serve_auth_token_file_reads_the_same_file_alike(tokens: Path) -> None:
    async with serve_command("--auth-token-file", str(tokens)) as line:
        address = line.split()[-1]
        assert await echo(address, "first-token") is None
        assert await echo(address, "third-token") is None
        for refused in ("# who may call us: one token per line", "second-token"):
            assert await echo(address, refused) is StatusCode.UNAUTHENTICATED
        write(tokens, "# rotated\nnew-token\n")
        with trio.fail_after(10):
            while await echo(address, "new-token") is not None:  # noqa: ASYNC110 - no reload event
                await trio.sleep(0.2)
        assert await echo(address, "first-token") is StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("command", [["avp", "serve", "--token-file"], ["serve", "--auth-token-file"]])
def test_a_file_without_a_token_is_one_line_and_exit_2(tmp_path: Path, command: list[str]) -> None:
    empty = tmp_path / "tokens"
    empty.write_text("# only a comment\n\n")
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", *command, str(empty), "--port", "0"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "expected at least one token" in line and command[-1] in line


@pytest.mark.parametrize("command", [["avp", "serve", "--token-file"], ["serve", "--auth-token-file"]])
def test_a_fifo_as_the_token_file_is_one_line_and_exit_2_at_once(tmp_path: Path, command: list[str]) -> None:
    """open() on a FIFO waits for a writer: both commands hung at startup, before any output."""
    fifo = tmp_path / "tokens"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", *command, str(fifo), "--port", "0"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"{fifo}: expected a regular file of tokens, got a FIFO" in line and command[-1] in line


def test_a_token_file_turned_fifo_or_too_large_revokes_every_token_without_waiting(tokens: Path) -> None:
    """Re-reads run on the event loop: a FIFO swapped in is refused at once, a regular file read at
    most MAX_TOKEN_FILE_BYTES (+1), and either fails closed until a good file is back."""
    from evergreen_trio.serving.auth import MAX_TOKEN_FILE_BYTES

    file = TokenFile(tokens, check_interval=0.001)
    tokens.unlink()
    os.mkfifo(tokens)
    time.sleep(0.002)
    assert file.principal("first-token") is None  # would block forever on open() before
    tokens.unlink()
    write(tokens, "first-token\n" + "#" * MAX_TOKEN_FILE_BYTES)
    time.sleep(0.002)
    assert file.principal("first-token") is None
    write(tokens, TOKENS)
    time.sleep(0.002)
    assert file.principal("first-token") is not None
    with pytest.raises(ConfigurationError, match=f"expected at most {MAX_TOKEN_FILE_BYTES} bytes of tokens"):
        write(tokens, "first-token\n" + "#" * MAX_TOKEN_FILE_BYTES)
        TokenFile(tokens)
    with pytest.raises(ConfigurationError, match="expected a regular file of tokens, got a directory"):
        TokenFile(tokens.parent)
