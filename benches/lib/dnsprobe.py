#!/usr/bin/env python3
"""Bounded DNS-over-UDP probe (stdlib only): liveness ping and latency percentiles.

dnsperf 2.10 (Debian bookworm) prints only the average latency, so this probe
measures per-query round-trip times and reports p50/p90/p99/p99.9/max.

  dnsprobe.py ping    --port P --name NAME [--type A]
  dnsprobe.py latency --port P --queries FILE --qps 1000 --duration 10

`latency` sends one query at a time (no pipelining), paced at --qps, so its
own load is bounded (qps x duration queries at most) and the measured time is
one request/response on an otherwise unqueued socket. Times include ~10-20 us
of Python overhead on both ends; compare runs with each other, not with
dnsperf's average.
"""
import argparse
import json
import random
import socket
import struct
import sys
import time

TYPES = {"A": 1, "NS": 2, "SOA": 6, "PTR": 12, "MX": 15, "TXT": 16, "AAAA": 28, "SRV": 33, "ANY": 255}
HOST = "127.0.0.1"  # loopback only


def encode_query(qid, name, qtype):
    labels = [l for l in name.rstrip(".").split(".") if l]
    q = b"".join(bytes([len(l)]) + l.encode() for l in labels) + b"\x00"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack(">HH", TYPES[qtype.upper()], 1)


def load_queries(path):
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2:
                out.append((parts[0], parts[1]))
    return out


def cmd_ping(a):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.5)
    s.sendto(encode_query(4242, a.name, a.type), (HOST, a.port))
    data, _ = s.recvfrom(65535)
    if struct.unpack(">H", data[:2])[0] != 4242:
        sys.exit(1)
    print("rcode", data[3] & 0xF)


def pct(sorted_vals, p):
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(round(p / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


def cmd_latency(a):
    qs = load_queries(a.queries)
    random.Random(a.seed).shuffle(qs)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((HOST, a.port))
    s.settimeout(a.timeout)
    interval = 1.0 / a.qps
    max_queries = int(a.qps * a.duration)
    rtts, lost, rcodes = [], 0, {}
    start = time.perf_counter()
    deadline = start + a.duration + 5.0  # hard stop even if everything times out
    qid = 0
    for n in range(max_queries):
        now = time.perf_counter()
        if now > deadline:
            break
        due = start + n * interval
        if due > now:
            time.sleep(due - now)
        name, qtype = qs[n % len(qs)]
        qid = (qid + 1) & 0xFFFF
        pkt = encode_query(qid, name, qtype)
        t0 = time.perf_counter_ns()
        s.send(pkt)
        try:
            while True:
                data = s.recv(65535)
                if struct.unpack(">H", data[:2])[0] == qid:
                    break  # stale answers of timed-out queries are skipped
            t1 = time.perf_counter_ns()
        except socket.timeout:
            lost += 1
            continue
        rtts.append((t1 - t0) / 1000.0)
        rc = data[3] & 0xF
        rcodes[rc] = rcodes.get(rc, 0) + 1
    elapsed = time.perf_counter() - start
    rtts.sort()
    res = {
        "sent": len(rtts) + lost,
        "received": len(rtts),
        "lost": lost,
        "elapsed_s": round(elapsed, 2),
        "mean_us": round(sum(rtts) / len(rtts), 1) if rtts else None,
        "p50_us": round(pct(rtts, 50), 1),
        "p90_us": round(pct(rtts, 90), 1),
        "p99_us": round(pct(rtts, 99), 1),
        "p999_us": round(pct(rtts, 99.9), 1),
        "max_us": round(rtts[-1], 1) if rtts else None,
        "rcodes": {str(k): v for k, v in sorted(rcodes.items())},
    }
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ping")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--type", default="SOA")
    p = sub.add_parser("latency")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--queries", required=True)
    p.add_argument("--qps", type=float, default=1000)
    p.add_argument("--duration", type=float, default=10)
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    {"ping": cmd_ping, "latency": cmd_latency}[a.cmd](a)


if __name__ == "__main__":
    main()
