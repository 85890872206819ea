"""The party's stream port (only the gateway may use it): a stored result's chunks from a byte
offset, and a leg's input arriving, made durable in group commits so an interrupted upload
resumes where the last commit left it.

Each stream runs in its own thread (:mod:`trainmaster.gateway.net.streams`); everything it
decides with the party's state (the gate, the leg's row, the audit log) runs on the event loop.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainmaster.gateway.crypto.chunks import ChunkOpener, ChunkSealer
from trainmaster.gateway.crypto.envelope import EnvelopeError, b64d, b64e
from trainmaster.gateway.crypto.tlsid import PeerIdentity
from trainmaster.gateway.models import Envelope, InputPut, MessageKind, ResultFetch, StreamReady
from trainmaster.gateway.net.filesink import FileSink, FileSource, SinkError, rehash_prefix
from trainmaster.gateway.net.streams import ChunkReader, Refused, StreamError, StreamSocket, on_loop
from trainmaster.gateway.party.faults import corrupt

if TYPE_CHECKING:
    from trainmaster.gateway.audit.log import Requester
    from trainmaster.gateway.party.core import PartyAgent
    from trainmaster.gateway.party.records import PartyLeg


def serve_stream(agent: "PartyAgent", conn: StreamSocket, peer: PeerIdentity | None) -> None:
    """One connection on the party's stream port."""
    assert agent.loop is not None
    try:
        env = Envelope.model_validate_json(conn.recv_frame())
        kind = env.header.kind
        if kind == MessageKind.result_fetch:
            requester, fetch = on_loop(agent.loop, _open, agent, env, kind, ResultFetch, peer)
            _send_result(agent, conn, requester, fetch)
        elif kind == MessageKind.input_put:
            requester, put = on_loop(agent.loop, _open, agent, env, kind, InputPut, peer)
            _receive_input(agent, conn, requester, put)
        else:
            raise Refused(400, f"the stream port takes result_fetch or input_put, not {kind.value}")
    except Refused as exc:
        conn.send_json({"status": exc.status, "detail": exc.detail})
    except EnvelopeError as exc:
        conn.send_json({"status": exc.status, "detail": exc.reason})
    except ValueError as exc:  # not an envelope
        conn.send_json({"status": 422, "detail": f"malformed stream request: {str(exc)[:300]}"})


def _open(agent: "PartyAgent", env: Envelope, kind: MessageKind, model: Any, peer: Any) -> tuple[Any, Any]:
    return agent.open_envelope(env, kind, {"gateway"}, model, peer)


def _leg(agent: "PartyAgent", task_id: str, data_id: str) -> "PartyLeg":
    record = agent.records.get(task_id, data_id)
    if record is None:
        raise Refused(404, f"no leg ({task_id}, {data_id}) at this party")
    return record


def _ready(agent: "PartyAgent", ready: StreamReady) -> dict[str, Any]:
    env = agent.ctx.seal_to(
        agent.gateway.name, MessageKind.stream_ready, ready.task_id, ready.data_id, ready.model_dump(mode="json")
    )
    return {"status": 200, "ready": env.model_dump(mode="json")}


def _send_result(agent: "PartyAgent", conn: StreamSocket, requester: "Requester", fetch: ResultFetch) -> None:
    """A stored result's chunks from ``fetch.offset`` (rounded down to a chunk), under a fresh key."""
    assert agent.loop is not None
    record = on_loop(agent.loop, _leg, agent, fetch.task_id, fetch.data_id)
    if record.state != "done" or not record.ok or record.size <= agent.cfg.stream_chunk_bytes:
        raise Refused(404, f"leg ({fetch.task_id}, {fetch.data_id}) has no stored result at this party")
    path = agent.files(record.task).result
    chunk = agent.cfg.stream_chunk_bytes
    offset = min(fetch.offset, record.size) // chunk * chunk
    key, stream_id = os.urandom(32), os.urandom(16).hex()
    try:
        source = FileSource(path, offset, record.size - offset, chunk)
    except FileNotFoundError:
        raise Refused(410, f"the result of leg ({fetch.task_id}, {fetch.data_id}) is no longer kept") from None
    sent = 0
    try:
        ready = StreamReady(
            task_id=fetch.task_id,
            data_id=fetch.data_id,
            offset=offset,
            total_bytes=record.size,
            chunk_bytes=chunk,
            key=b64e(key),
            stream_id=stream_id,
        )
        conn.send_json(on_loop(agent.loop, _ready, agent, ready))
        sealer = ChunkSealer(key, stream_id, first_index=offset // chunk)
        framed = sealer.buffer(chunk)

        def frames() -> Iterator[memoryview]:
            nonlocal sent
            left = record.size - offset
            while True:
                if left:
                    buf, n = source.next()
                    left -= n
                    frame = sealer.seal_into(memoryview(buf)[:n], left == 0, framed)
                    source.release(buf)
                else:
                    n, frame = 0, sealer.seal_into(b"", True, framed)
                yield frame
                sent += n
                if left == 0:
                    return

        faults = agent.cfg.fault_stream
        for frame in corrupt(frames(), faults) if faults not in ("", "misattest") else frames():
            conn.send_chunk(frame)
    except SinkError as exc:
        raise StreamError(str(exc)) from None
    finally:
        source.close()
        on_loop(
            agent.loop,
            agent.audit.append,
            "result.fetch",
            requester,
            task_id=fetch.task_id,
            data_id=fetch.data_id,
            offset=offset,
            bytes=sent,
            complete=offset + sent == record.size,
        )


def _receive_input(agent: "PartyAgent", conn: StreamSocket, requester: "Requester", put: InputPut) -> None:
    """A leg's input, from the last committed offset on: each chunk checked, written, hashed; a
    group commit (fdatasync, then the offset in the leg's row) every ``stream_commit_bytes``; at
    the end the size and SHA-256 the initiator signed in its task creation request are checked."""
    assert agent.loop is not None
    record = on_loop(agent.loop, _leg, agent, put.task_id, put.data_id)
    declared = record.task.input
    if declared is None:
        raise Refused(400, f"leg ({put.task_id}, {put.data_id}) takes no input")
    if record.input_done:
        raise Refused(409, f"the input of leg ({put.task_id}, {put.data_id}) has arrived already")
    if record.state != "created":
        raise Refused(409, f"leg ({put.task_id}, {put.data_id}) has run; its input can no longer change")
    key = record.key
    if not on_loop(agent.loop, _claim, agent, key):
        raise Refused(503, f"an input for leg ({put.task_id}, {put.data_id}) is arriving already; retry when it ends")
    try:
        _take_input(agent, conn, requester, put, record)
    finally:
        on_loop(agent.loop, agent.uploading.discard, key)


def _claim(agent: "PartyAgent", key: tuple[str, str]) -> bool:
    """One upload per leg at a time (a resend can arrive before the broken one's thread has ended)."""
    if key in agent.uploading:
        return False
    agent.uploading.add(key)
    return True


def _take_input(
    agent: "PartyAgent", conn: StreamSocket, requester: "Requester", put: InputPut, record: "PartyLeg"
) -> None:
    assert agent.loop is not None
    declared = record.task.input
    assert declared is not None
    files = agent.files(record.task)
    assert files.input is not None
    chunk = put.chunk_bytes
    offset = min(record.input_bytes, declared.size) // chunk * chunk
    digest = hashlib.sha256()
    fd = os.open(files.input, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    received = offset
    try:
        rehash_prefix(fd, offset, digest, "the committed part of the input")
        os.ftruncate(fd, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        ready = StreamReady(
            task_id=put.task_id, data_id=put.data_id, offset=offset, total_bytes=declared.size, chunk_bytes=chunk
        )
        conn.send_json(on_loop(agent.loop, _ready, agent, ready))
        opener = ChunkOpener(b64d(put.key), put.stream_id, declared.size, chunk, offset // chunk, offset)
        reader = ChunkReader(conn, opener)

        loop = agent.loop

        def commit(upto: int) -> None:
            on_loop(loop, agent.records.input_progress, put.task_id, put.data_id, upto)

        sink = FileSink(fd, digest, chunk, offset, agent.cfg.stream_commit_bytes, commit)
        try:
            while True:
                plain = sink.buffer()
                view, last = reader.next_into(plain)
                sink.put(plain, len(view))
                if last:
                    break
        finally:
            received = sink.close()  # what was checked stays; a resumed upload starts after the last commit
        opener.finish()
        if digest.hexdigest() != declared.sha256:
            os.ftruncate(fd, 0)
            on_loop(agent.loop, agent.records.input_progress, put.task_id, put.data_id, 0)
            raise Refused(422, "the input does not match the SHA-256 its initiator signed; it was discarded")
        os.fsync(fd)
        on_loop(agent.loop, agent.records.input_progress, put.task_id, put.data_id, received, True)
        conn.send_json({"status": 200, "bytes": received, "sha256": declared.sha256})
    except SinkError as exc:
        raise Refused(507, f"the party could not store the input: {exc}") from None
    finally:
        os.close(fd)
        on_loop(
            agent.loop,
            agent.audit.append,
            "input.receive",
            requester,
            task_id=put.task_id,
            data_id=put.data_id,
            offset=offset,
            bytes=received - offset,
            complete=received == declared.size,
        )
