"""The gateway's stream port (initiators only): a leg's stored result fetched from its party, and
a leg's input sent to its party, relayed cut-through a chunk at a time.

Each hop has its own fresh key: the gateway decrypts what one side sealed for it and re-encrypts
to the other (as the spec asks), into two reused buffers, and holds nothing but them: the window
between a fast and a slow side is one chunk here plus the sockets' buffers, whatever the size.
Nothing is spooled: a stored result stays at its party until the initiator has fetched it (or its
retention passes), an input is committed at the party in group commits, and either resumes from
a chunk boundary after any side was killed. What the gateway decides with its state (the gate,
the mapping table, the audit log) runs on its event loop; the bytes stay in the stream's thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from trainmaster.gateway.audit.log import Requester
from trainmaster.gateway.crypto.chunks import ChunkOpener, ChunkSealer
from trainmaster.gateway.crypto.envelope import EnvelopeError, PublicIdentity, b64d, b64e
from trainmaster.gateway.crypto.tlsid import PeerIdentity, dns_name
from trainmaster.gateway.models import Envelope, InputPut, LegOutcome, MessageKind, ResultFetch, StreamReady
from trainmaster.gateway.net.streams import (
    ChunkReader,
    Refused,
    StreamAborted,
    StreamError,
    StreamSocket,
    connect,
    on_loop,
)
from trainmaster.gateway.net.tls import client_ssl_context

if TYPE_CHECKING:
    from trainmaster.gateway.relay.core import Relay


def serve_stream(relay: "Relay", conn: StreamSocket, peer: PeerIdentity | None) -> None:
    """One connection on the gateway's stream port."""
    assert relay.loop is not None
    try:
        env = Envelope.model_validate_json(conn.recv_frame())
        kind = env.header.kind
        if kind == MessageKind.result_fetch:
            requester, fetch = on_loop(relay.loop, relay.open_envelope, env, kind, {"initiator"}, ResultFetch, peer)
            _relay_result(relay, conn, requester, fetch)
        elif kind == MessageKind.input_put:
            requester, put = on_loop(relay.loop, relay.open_envelope, env, kind, {"initiator"}, InputPut, peer)
            _relay_input(relay, conn, requester, put)
        else:
            raise Refused(400, f"the stream port takes result_fetch or input_put, not {kind.value}")
    except Refused as exc:
        conn.send_json({"status": exc.status, "detail": exc.detail})
    except EnvelopeError as exc:
        conn.send_json({"status": exc.status, "detail": exc.reason})
    except ValueError as exc:  # not an envelope
        conn.send_json({"status": 422, "detail": f"malformed stream request: {str(exc)[:300]}"})


def _party_of(relay: "Relay", requester: Requester, task_id: str, data_id: str, want: str) -> PublicIdentity:
    """The leg's party, if the requester owns the task and the leg can do ``want`` (on the loop)."""
    try:
        relay.owned(task_id, requester.name)
    except Exception as exc:  # HTTPException: 404 / 403
        raise Refused(getattr(exc, "status_code", 403), str(getattr(exc, "detail", exc))) from None
    leg = relay.table.legs(task_id).get(data_id)
    if leg is None:
        raise Refused(404, f"data id {data_id!r} is not a leg of task {task_id!r}")
    if want == "result" and (leg.outcome != LegOutcome.result.value or leg.stream_bytes is None):
        raise Refused(404, f"leg ({task_id}, {data_id}) has no stored result (outcome: {leg.outcome or 'none yet'})")
    if want == "input":
        if leg.input is None:
            raise Refused(400, f"leg ({task_id}, {data_id}) takes no input")
        if leg.input_done:
            raise Refused(409, f"the input of leg ({task_id}, {data_id}) has reached its party already")
        if leg.outcome is not None:
            raise Refused(409, f"leg ({task_id}, {data_id}) is finished ({leg.outcome})")
    party = relay.ctx.roster[leg.party]
    if not party.stream_endpoint:
        raise Refused(502, f"party {leg.party!r} has no stream endpoint in the roster")
    relay.inflight["streams"] += 1
    return party


def _to_party(
    relay: "Relay", party: PublicIdentity, kind: MessageKind, task_id: str, data_id: str, payload: Any
) -> tuple[StreamSocket, StreamReady]:
    """Open a stream to the leg's party and take its sealed answer (refusals pass on to the initiator)."""
    assert relay.loop is not None and party.stream_endpoint is not None
    conn = connect(
        client_ssl_context(relay.cfg),
        party.stream_endpoint,
        dns_name(party.name, "party"),
        relay.cfg.body_timeout_s,
        f"party {party.name!r}",
    )
    try:
        env = relay.ctx.seal_to(party.name, kind, task_id, data_id, payload.model_dump(mode="json"))
        conn.send_frame(env.model_dump_json().encode())
        answer = conn.recv_json()
        if answer["status"] != 200:
            raise Refused(answer["status"], f"party {party.name!r}: {answer.get('detail', '')}")
        ready = on_loop(relay.loop, _open_ready, relay, party.name, answer.get("ready"))
        if (ready.task_id, ready.data_id) != (task_id, data_id):
            raise Refused(502, f"party {party.name!r} answered for another leg")
        return conn, ready
    except BaseException:
        conn.close()
        raise


def _open_ready(relay: "Relay", party: str, raw: Any) -> StreamReady:
    sender, ready = relay.ctx.gate.open(
        Envelope.model_validate(raw), MessageKind.stream_ready, {"party"}, StreamReady, check_peer=False
    )  # the TLS server name was checked
    if sender.name != party:
        raise EnvelopeError(403, f"stream answer signed by {sender.name!r}, not by party {party!r}")
    return ready


def _ready_for(relay: "Relay", owner: str, ready: StreamReady) -> dict[str, Any]:
    env = relay.ctx.seal_to(
        owner, MessageKind.stream_ready, ready.task_id, ready.data_id, ready.model_dump(mode="json")
    )
    return {"status": 200, "ready": env.model_dump(mode="json")}


def _end(relay: "Relay", requester: Requester, event: str, **fields: Any) -> None:
    relay.inflight["streams"] -= 1
    relay.audit.append(event, requester, **fields)


def _relay_result(relay: "Relay", conn: StreamSocket, requester: Requester, fetch: ResultFetch) -> None:
    """Party's chunks (its key) -> checked, re-encrypted (a fresh key) -> the initiator."""
    assert relay.loop is not None
    party = on_loop(relay.loop, _party_of, relay, requester, fetch.task_id, fetch.data_id, "result")
    sent, detail = 0, ""
    ready: StreamReady | None = None
    try:
        upstream, theirs = _to_party(relay, party, MessageKind.result_fetch, fetch.task_id, fetch.data_id, fetch)
        try:
            if theirs.key is None or theirs.stream_id is None:
                raise Refused(502, f"party {party.name!r} sent no stream key")
            key, stream_id = os.urandom(32), os.urandom(16).hex()
            ready = theirs.model_copy(update={"key": b64e(key), "stream_id": stream_id})
            conn.send_json(on_loop(relay.loop, _ready_for, relay, requester.name, ready))
            first = theirs.offset // theirs.chunk_bytes
            opener = ChunkOpener(
                b64d(theirs.key), theirs.stream_id, theirs.total_bytes, theirs.chunk_bytes, first, theirs.offset
            )
            sealer = ChunkSealer(key, stream_id, first)
            reader = ChunkReader(upstream, opener)
            plain, framed = bytearray(theirs.chunk_bytes), sealer.buffer(theirs.chunk_bytes)
            while True:
                try:  # a broken party stream (StreamError) ends ours: the initiator resumes
                    view, last = reader.next_into(plain)
                except EnvelopeError as exc:  # the party ended it, or not what its key and order allow: final
                    why = f"the party ended the stream: {exc.why}" if isinstance(exc, StreamAborted) else exc.reason
                    conn.send_chunk(sealer.abort(f"party {party.name!r}'s stream refused at the gateway: {why}"))
                    return
                conn.send_chunk(sealer.seal_into(view, last, framed))
                sent += len(view)
                if last:
                    break
            opener.finish()
        finally:
            upstream.close()
    except StreamError as exc:
        detail = str(exc)
        if ready is None:
            raise Refused(502, f"party {party.name!r}: {exc}") from None
    finally:
        offset = ready.offset if ready is not None else fetch.offset
        on_loop(
            relay.loop,
            _end,
            relay,
            requester,
            "result.fetch",
            task_id=fetch.task_id,
            data_id=fetch.data_id,
            party=party.name,
            offset=offset,
            bytes=sent,
            complete=ready is not None and offset + sent == ready.total_bytes,
            detail=detail[:300],
        )


def _relay_input(relay: "Relay", conn: StreamSocket, requester: Requester, put: InputPut) -> None:
    """Initiator's chunks (its key) -> checked, re-encrypted (a fresh key) -> the leg's party, which
    commits them; its final answer (the size and digest checked) goes back to the initiator."""
    assert relay.loop is not None
    party = on_loop(relay.loop, _party_of, relay, requester, put.task_id, put.data_id, "input")
    moved, done, detail = 0, False, ""
    ready: StreamReady | None = None
    try:
        key, stream_id = os.urandom(32), os.urandom(16).hex()
        onward = put.model_copy(update={"key": b64e(key), "stream_id": stream_id})
        upstream, ready = _to_party(relay, party, MessageKind.input_put, put.task_id, put.data_id, onward)
        try:
            conn.send_json(on_loop(relay.loop, _ready_for, relay, requester.name, ready))
            first = ready.offset // ready.chunk_bytes
            opener = ChunkOpener(
                b64d(put.key), put.stream_id, ready.total_bytes, ready.chunk_bytes, first, ready.offset
            )
            sealer = ChunkSealer(key, stream_id, first)
            reader = ChunkReader(conn, opener)
            plain, framed = bytearray(ready.chunk_bytes), sealer.buffer(ready.chunk_bytes)
            while True:
                try:
                    view, last = reader.next_into(plain)
                except StreamAborted as exc:
                    detail = f"the initiator ended the stream: {exc.why}"
                    upstream.send_chunk(sealer.abort(detail))
                    return
                except EnvelopeError as exc:
                    detail = f"the initiator's stream refused at the gateway: {exc.reason}"
                    upstream.send_chunk(sealer.abort(detail))
                    conn.send_json({"status": exc.status, "detail": detail})
                    return
                upstream.send_chunk(sealer.seal_into(view, last, framed))
                moved += len(view)
                if last:
                    break
            opener.finish()
            answer = upstream.recv_json()
            done = answer["status"] == 200
            if done:
                on_loop(relay.loop, relay.table.mark_input_done, put.task_id, put.data_id)
            else:
                detail = f"party {party.name!r}: {answer.get('detail', '')}"
                answer = {"status": answer["status"], "detail": detail}
            conn.send_json(answer)
        finally:
            upstream.close()
    except StreamError as exc:
        detail = str(exc)
        if ready is None:
            raise Refused(502, f"party {party.name!r}: {exc}") from None
    finally:
        on_loop(
            relay.loop,
            _end,
            relay,
            requester,
            "input.put",
            task_id=put.task_id,
            data_id=put.data_id,
            party=party.name,
            offset=ready.offset if ready is not None else 0,
            bytes=moved,
            complete=done,
            detail=detail[:300],
        )
