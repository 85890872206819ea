"""Small network programs the testbed tests run *inside* a host (``python netprobe.py ...``).

serve PORT BYTES_OUT   accept one TCP connection, read until EOF, print bytes read
send HOST PORT BYTES   connect, send BYTES, print "<bytes> <seconds>"
connect HOST PORT      try to connect, print "ok" or the errno name
"""

from __future__ import annotations

import errno
import socket
import sys
import time


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        print("listening", flush=True)
        server.settimeout(60)
        conn, _ = server.accept()
        total = 0
        with conn:
            conn.settimeout(60)
            while chunk := conn.recv(1 << 16):
                total += len(chunk)
            print(total, flush=True)


def send(host: str, port: int, count: int) -> None:
    block = b"x" * (1 << 16)
    with socket.create_connection((host, port), timeout=30) as sock:
        t0 = time.monotonic()
        left = count
        while left > 0:
            left -= sock.send(block[:left])
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # EOF from the server: every byte has crossed the link
        print(count, time.monotonic() - t0, flush=True)


def connect(host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=3):
            print("ok")
    except OSError as exc:
        print(errno.errorcode.get(exc.errno or 0, type(exc).__name__))


if __name__ == "__main__":
    verb, *args = sys.argv[1:]
    if verb == "serve":
        serve(int(args[0]))
    elif verb == "send":
        send(args[0], int(args[1]), int(args[2]))
    else:
        connect(args[0], int(args[1]))
