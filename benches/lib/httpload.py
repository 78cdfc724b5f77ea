#!/usr/bin/env python3
"""Count-bounded bulk REST client (stdlib only) for populating koder-dns.

  httpload.py post --port P --path /api/v1/services/register --file bodies.jsonl
                   [--procs 4] [--conns 1] [--key KEY] [--limit N] [--tls]

Sends every line of FILE (a JSON body) exactly once as a POST, split over
--procs processes, each with --conns threads, each thread with one keep-alive
HTTP/1.1 connection to 127.0.0.1:P (HTTPS with --tls, the certificate not checked: a
benchmark's own, on loopback) (registrations wait for a durable commit,
so more connections than cores helps). Prints one JSON line: {"sent", "ok", "status": {code: n},
"elapsed_s", "rate"}. Exits non-zero if any request failed at the socket level
or (with --strict) did not return 2xx.
"""
import argparse
import json
import multiprocessing as mp
import socket
import ssl
import sys
import time

HOST = "127.0.0.1"  # loopback only


class Conn:
    def __init__(self, port, tls=False, timeout=30.0):
        self.port = port
        self.tls = tls
        self.timeout = timeout
        self.sock = None
        self.buf = b""

    def connect(self):
        self.sock = socket.create_connection((HOST, self.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            self.sock = ctx.wrap_socket(self.sock)
        self.buf = b""

    def _read_more(self):
        chunk = self.sock.recv(262144)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buf += chunk

    def _read_until(self, sep):
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                out, self.buf = self.buf[:i], self.buf[i + len(sep):]
                return out
            self._read_more()

    def _read_n(self, n):
        while len(self.buf) < n:
            self._read_more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def request(self, method, path, body=b"", headers=()):
        if self.sock is None:
            self.connect()
        head = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{self.port}", f"Content-Length: {len(body)}"]
        head.extend(headers)
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        status_and_headers = self._read_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(status_and_headers[0].split()[1])
        hdrs = {}
        for line in status_and_headers[1:]:
            k, _, v = line.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if "content-length" in hdrs:
            data = self._read_n(int(hdrs["content-length"]))
        elif hdrs.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self._read_until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    self._read_until(b"\r\n")
                    break
                parts.append(self._read_n(size))
                self._read_n(2)
            data = b"".join(parts)
        else:
            data = b""
        if hdrs.get("connection", "").lower() == "close":
            self.sock.close()
            self.sock = None
        return status, data


def merge(results):
    """Adds up (status counts, errors, first error sample) from several workers."""
    status, errors, sample = {}, 0, None
    for st, err, smp in results:
        for k, v in st.items():
            status[k] = status.get(k, 0) + v
        errors += err
        sample = sample or smp
    return status, errors, sample


def worker(args):
    port, path, key, bodies, deadline, conns, tls = args
    if conns > 1:
        import threading
        results = [None] * conns
        def run(i):
            results[i] = worker((port, path, key, bodies[i::conns], deadline, 1, tls))
        ts = [threading.Thread(target=run, args=(i,)) for i in range(conns)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return merge(results)
    c = Conn(port, tls)
    status = {}
    errors = 0
    sample = None
    hdrs = ["Content-Type: application/json"]
    if key:
        hdrs.append(f"X-API-Key: {key}")
    for body in bodies:
        if time.time() > deadline:
            break
        for attempt in range(3):
            try:
                st, data = c.request("POST", path, body, hdrs)
                break
            except (OSError, ConnectionError, ValueError):
                c.sock = None
                st, data = None, b""
        if st is None:
            errors += 1
            continue
        status[st] = status.get(st, 0) + 1
        if not 200 <= st < 300 and sample is None:
            sample = data[:300].decode("utf-8", "replace")
    return status, errors, sample


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("post")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--file", required=True)
    p.add_argument("--key", default="")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--conns", type=int, default=1, help="keep-alive connections (threads) per process")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=600)
    p.add_argument("--strict", action="store_true")
    p.add_argument("--tls", action="store_true", help="HTTPS (the certificate is not checked)")
    a = ap.parse_args()

    with open(a.file, "rb") as f:
        bodies = [l.rstrip(b"\n") for l in f if l.strip()]
    if a.limit:
        bodies = bodies[: a.limit]
    procs = max(1, min(a.procs, len(bodies)))
    deadline = time.time() + a.max_seconds
    slices = [(a.port, a.path, a.key, bodies[i::procs], deadline, a.conns, a.tls) for i in range(procs)]
    t0 = time.perf_counter()
    with mp.Pool(procs) as pool:
        results = pool.map(worker, slices)
    elapsed = time.perf_counter() - t0
    status, errors, sample = merge(results)
    ok = sum(v for k, v in status.items() if 200 <= k < 300)
    out = {
        "sent": sum(status.values()) + errors,
        "ok": ok,
        "socket_errors": errors,
        "status": {str(k): v for k, v in sorted(status.items())},
        "elapsed_s": round(elapsed, 2),
        "rate": round(ok / elapsed, 1) if elapsed > 0 else 0,
    }
    if sample:
        out["first_error_body"] = sample
    print(json.dumps(out))
    if errors or (a.strict and ok != len(bodies)):
        sys.exit(1)


if __name__ == "__main__":
    main()
