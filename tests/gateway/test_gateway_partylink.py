"""The gateway's lean link to parties (partylink): HTTP/1.1 over mutual TLS on asyncio's transport.

Gateway mechanism, step 5-6 (the data transfer request to a party and its result): bodies come back
whole whether sent with a Content-Length or chunked, a kept-alive connection the party closed is
replaced with a freshly sealed body (never a replay), and a party that breaks off mid-body is a
transport failure (the leg's ``party_unavailable``), never a truncated result."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from trainmaster.gateway.relay.partylink import PartyLinkError, PartyLinks

NAME = "p0.party.test"


def _tls(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context for ``NAME`` and a client context trusting only it (self-signed)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (tmp / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "k.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp / "c.pem", tmp / "k.pem")
    client = ssl.create_default_context(cafile=str(tmp / "c.pem"))
    return server, client


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _request_body(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def _run(tmp: Path, handler: Handler, client_side: Callable[[PartyLinks, str], Awaitable[None]]) -> None:
    server_ctx, client_ctx = _tls(tmp)

    async def main() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        links = PartyLinks(client_ctx)
        try:
            async with asyncio.timeout(20):
                await client_side(links, f"https://127.0.0.1:{port}")
        finally:
            await links.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_chunked_and_sized_bodies_arrive_whole_and_connections_are_kept(tmp_path: Path) -> None:
    """Gateway mechanism (data transfer request): one connection serves several requests."""
    payload = bytes(range(256)) * 9000  # 2.3 MB: several reads per chunk
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                body = await _request_body(reader)
            except asyncio.IncompleteReadError:
                break
            if body == b"chunked":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: x/y\r\ntransfer-encoding: chunked\r\n\r\n")
                for piece in (payload[:5], payload[5:1_000_000], payload[1_000_000:]):
                    writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
        writer.close()

    async def client(links: PartyLinks, url: str) -> None:
        async with links.post(url, "/v1/transfer", lambda: b"chunked", NAME) as resp:
            assert resp.status == 200 and resp.content_type == "x/y"
            assert b"".join([b async for b in resp.blocks()]) == payload
        async with links.post(url, "/v1/transfer", lambda: b"sized", NAME) as resp:
            assert resp.status == 404
            assert await resp.read(100) == b"sized"

    _run(tmp_path, handler, client)
    assert connections == 1


def test_stale_kept_connection_is_replaced_with_a_fresh_body(tmp_path: Path) -> None:
    """A connection the party closed while idle: the request goes again on a new connection, with a
    newly made body (a new envelope), and only once."""
    bodies: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        bodies.append(await _request_body(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # no keep-alive honoured: the pooled connection is dead

    made = iter([b"first", b"second", b"third"])

    async def client(links: PartyLinks, url: str) -> None:
        for _ in range(2):
            async with links.post(url, "/v1/transfer", lambda: next(made), NAME) as resp:
                assert await resp.read(10) == b"ok"

    _run(tmp_path, handler, client)
    assert bodies[0] == b"first" and bodies[-1] in (b"second", b"third") and len(bodies) == 2


def test_party_breaking_off_mid_body_is_a_transport_failure(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10000\r\n" + b"x" * 100)
        await writer.drain()
        writer.close()

    async def client(links: PartyLinks, url: str) -> None:
        async with links.post(url, "/v1/transfer", lambda: b"x", NAME) as resp:
            with pytest.raises(PartyLinkError):
                async for _ in resp.blocks():
                    pass

    _run(tmp_path, handler, client)


def test_wrong_server_name_and_no_server_are_transport_failures(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def client(links: PartyLinks, url: str) -> None:
        with pytest.raises(PartyLinkError, match="SSL|certificate"):
            async with links.post(url, "/v1/transfer", lambda: b"x", "p1.party.test"):
                pass
        with pytest.raises(PartyLinkError):
            async with links.post("https://127.0.0.1:1", "/v1/transfer", lambda: b"x", NAME):
                pass

    _run(tmp_path, handler, client)
