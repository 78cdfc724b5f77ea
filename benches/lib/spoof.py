#!/usr/bin/env python3
"""Spoofed-source DNS flood over loopback (stdlib only; a raw socket, so root).

  spoof.py --port P --name NAME [--type SRV] --qps 20000 --duration 10 \
           --sources random|victim [--victim 127.2.0.0]

Every datagram asks the same question, from a forged source address: `random` draws it
from all of 127.0.0.0/8 except 127.0.0.0/16 (where the benchmark's real clients sit), so
each /24 sees a query now and then, as a flood from random sources looks to a rate limiter;
`victim` draws it from one /24, as a reflection attack aimed at that network looks. Only
127.0.0.1 is ever the destination. The replies go to the forged loopback addresses, where
nothing listens. Paced in 1 ms steps; bounded by --duration. Prints one JSON line: sent,
elapsed_s.
"""
import argparse
import json
import random
import socket
import struct
import time

TYPES = {"A": 1, "TXT": 16, "AAAA": 28, "SRV": 33}
DEST = "127.0.0.1"  # loopback only


def query(qid, name, qtype):
    labels = [l for l in name.rstrip(".").split(".") if l]
    q = b"".join(bytes([len(l)]) + l.encode() for l in labels) + b"\x00"
    return struct.pack(">HHHHHH", qid, 0x0000, 1, 0, 0, 0) + q + struct.pack(">HH", TYPES[qtype], 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--type", default="SRV")
    ap.add_argument("--qps", type=int, default=20000)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--sources", choices=["random", "victim"], default="random")
    ap.add_argument("--victim", default="127.2.0.0")
    a = ap.parse_args()
    assert a.qps > 0 and 0 < a.duration <= 600
    rng = random.Random(29)
    victim = socket.inet_aton(a.victim)[:3]
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
    dest = socket.inet_aton(DEST)
    payload = query(0x2929, a.name, a.type)
    udp_len = 8 + len(payload)

    def packet():
        if a.sources == "random":
            src = bytes([127, rng.randrange(1, 256), rng.randrange(256), rng.randrange(1, 255)])
        else:
            src = victim + bytes([rng.randrange(1, 255)])
        # IPv4 header: the kernel fills in the checksum, the id and the total length.
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0, 64, 17, 0, src, dest)
        udp = struct.pack("!HHHH", rng.randrange(1024, 65536), a.port, udp_len, 0)
        return ip + udp + payload

    per_ms = a.qps / 1000.0
    start = time.perf_counter()
    sent = 0
    step = 0
    while True:
        now = time.perf_counter()
        if now - start >= a.duration:
            break
        due = int((step + 1) * per_ms)
        while sent < due:
            try:
                sock.sendto(packet(), (DEST, 0))
            except OSError:
                pass  # a full queue: that datagram is lost, as on a wire
            sent += 1
        step += 1
        wait = start + step / 1000.0 - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    print(json.dumps({"sent": sent, "elapsed_s": round(time.perf_counter() - start, 2)}))


if __name__ == "__main__":
    main()
