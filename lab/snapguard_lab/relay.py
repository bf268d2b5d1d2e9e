"""A TCP relay: `python -m snapguard_lab.relay LISTEN_PORT TARGET_HOST TARGET_PORT` listens on
127.0.0.1:LISTEN_PORT and joins each connection to TARGET_HOST:TARGET_PORT.

Started in a node's network namespace (snapguard_lab.k8s_nodes), it makes the registry on the
bridge answer as `localhost:<port>` on that node, which is what containerd's CRI restore needs:
CRImportCheckpoint pulls the checkpoint's base image with containerd's default resolver (not the
CRI plugin's hosts.toml), which speaks plain HTTP only to localhost. Prints "ready" once listening.
"""

from __future__ import annotations

import socket
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(conn: socket.socket, target: tuple[str, int]) -> None:
    try:
        up = socket.create_connection(target, timeout=10)
    except OSError:
        conn.close()
        return
    up.settimeout(None)
    threading.Thread(target=_pipe, args=(up, conn), daemon=True).start()
    _pipe(conn, up)


def main() -> None:
    port, host, target_port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    lo = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lo.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lo.bind(("127.0.0.1", port))
    lo.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = lo.accept()
        threading.Thread(target=_serve, args=(conn, (host, target_port)), daemon=True).start()


if __name__ == "__main__":
    main()
