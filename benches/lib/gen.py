#!/usr/bin/env python3
"""Generate benchmark inputs from ONE description of a service fleet.

The same description (S services x I instances) becomes:

  service.koder.zone   BIND zone file for NSD and Knot: exactly the SRV/A/TXT
                       records that koder-dns serves for the same registrations
  register.jsonl       one REST registration body per line (for koder-dns)
  heartbeat.jsonl      one heartbeat body {"id": ...} per line
  queries.txt          dnsperf input: "name TYPE" lines in the query mix
  check.txt            a few "name TYPE" lines used to compare answers
  fill.jsonl           (with --fill-services) registration bodies of a second,
                       filler fleet "fill<n>": koder-dns only, never in the
                       zone file or the queries (registry size without
                       changing what is asked)

Instance k (0-based, k = service * I + instance):
  name     svc<service>                (zero padded)
  address  IPv4 10.x.y.z built from k+1 (only data: nothing connects to it)
  port     8000 + instance
  id       <name>-<address>-<port>     (the server's default id)
  weight 100, priority 10, metadata {"version": "1.4.2", "zone": "z<k%3>"}

usage: gen.py OUTDIR [--services N] [--instances N] [--domain D]
                     [--queries N] [--mix srv=60,a=20,txt=10,nx=10] [--seed N]
                     [--ttl-s N] [--lease-s N] [--no-zone]
                     [--fill-services N] [--fill-instances N]

Filler instance j (0-based) is numbered k = S*I + j for its address (no
address is shared with the main fleet), name fill<service>.
"""
import argparse
import json
import os
import random


def addr_of(k):
    n = k + 1
    return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def hex_of(addr):
    return "".join(f"{int(o):02x}" for o in addr.split("."))


def instances(services, per, width, prefix="svc", k0=0):
    for s in range(services):
        name = f"{prefix}{s:0{width}d}"
        for i in range(per):
            k = k0 + s * per + i
            address = addr_of(k)
            port = 8000 + i
            yield {
                "id": f"{name}-{address}-{port}",
                "name": name,
                "address": address,
                "port": port,
                "protocol": "tcp",
                "weight": 100,
                "priority": 10,
                "metadata": {"version": "1.4.2", "zone": f"z{k % 3}"},
            }


def txt_rdata(inst):
    # koder-dns: one TXT per instance: "id=<id>", then key=value sorted by key,
    # each as its own character-string.
    parts = [f"id={inst['id']}"] + [f"{k}={v}" for k, v in sorted(inst["metadata"].items())]
    return " ".join('"' + p.replace('"', '\\"') + '"' for p in parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--services", type=int, default=200)
    ap.add_argument("--instances", type=int, default=5)
    ap.add_argument("--domain", default="service.koder")
    ap.add_argument("--queries", type=int, default=20000)
    ap.add_argument("--mix", default="srv=60,a=20,txt=10,nx=10")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--ttl-s", type=int, default=5, help="record TTL (koder-dns --dns-ttl)")
    ap.add_argument("--neg-ttl-s", type=int, default=5, help="SOA minimum (koder-dns --negative-ttl)")
    ap.add_argument("--lease-s", type=int, default=3600, help="ttl_ns of each registration")
    ap.add_argument("--no-zone", action="store_true", help="only register.jsonl / heartbeat.jsonl")
    ap.add_argument("--fill-services", type=int, default=0, help="filler fleet services (fill.jsonl)")
    ap.add_argument("--fill-instances", type=int, default=5, help="instances per filler service")
    a = ap.parse_args()

    os.makedirs(a.outdir, exist_ok=True)
    dom = a.domain.rstrip(".")
    width = max(3, len(str(a.services - 1)))
    insts = list(instances(a.services, a.instances, width))
    lease_ns = a.lease_s * 1_000_000_000

    with open(os.path.join(a.outdir, "register.jsonl"), "w") as f:
        for inst in insts:
            body = dict(inst, ttl_ns=lease_ns)
            f.write(json.dumps(body, separators=(",", ":")) + "\n")
    with open(os.path.join(a.outdir, "heartbeat.jsonl"), "w") as f:
        for inst in insts:
            f.write(json.dumps({"id": inst["id"]}, separators=(",", ":")) + "\n")
    nfill = a.fill_services * a.fill_instances
    if nfill:
        if len(insts) + nfill >= 1 << 24:
            raise SystemExit("too many instances for the 10.x.y.z address scheme")
        fwidth = max(3, len(str(a.fill_services - 1)))
        with open(os.path.join(a.outdir, "fill.jsonl"), "w") as f:
            for inst in instances(a.fill_services, a.fill_instances, fwidth, "fill", len(insts)):
                f.write(json.dumps(dict(inst, ttl_ns=lease_ns), separators=(",", ":")) + "\n")
    if a.no_zone:
        return

    # ---- zone file (what koder-dns serves for these registrations)
    by_name = {}
    for inst in insts:
        by_name.setdefault(inst["name"], []).append(inst)
    z = []
    z.append(f"$ORIGIN {dom}.")
    z.append(f"$TTL {a.ttl_s}")
    z.append(f"@ IN SOA ns.{dom}. hostmaster.{dom}. 1 3600 600 86400 {a.neg_ttl_s}")
    z.append(f"@ IN NS ns.{dom}.")
    z.append("ns IN A 127.0.0.1")
    addrs = {}
    for name, lst in by_name.items():
        for inst in lst:
            h = hex_of(inst["address"])
            addrs[h] = inst["address"]
            z.append(f"_{name}._tcp IN SRV {inst['priority']} {inst['weight']} {inst['port']} {h}.addr")
        for addr in sorted({i["address"] for i in lst}):
            z.append(f"{name} IN A {addr}")
        for inst in lst:
            z.append(f"{name} IN TXT {txt_rdata(inst)}")
            z.append(f"_{name}._tcp IN TXT {txt_rdata(inst)}")
    for h, addr in sorted(addrs.items()):
        z.append(f"{h}.addr IN A {addr}")
    with open(os.path.join(a.outdir, f"{dom}.zone"), "w") as f:
        f.write("\n".join(z) + "\n")

    # ---- query mix
    mix = {}
    for part in a.mix.split(","):
        k, v = part.split("=")
        mix[k.strip().lower()] = float(v)
    unknown = set(mix) - {"srv", "a", "txt", "nx"}
    if unknown:
        raise SystemExit(f"unknown mix keys: {unknown}")
    kinds, weights = zip(*mix.items())
    rnd = random.Random(a.seed)
    names = sorted(by_name)
    with open(os.path.join(a.outdir, "queries.txt"), "w") as f:
        for n in range(a.queries):
            kind = rnd.choices(kinds, weights)[0]
            name = rnd.choice(names)
            if kind == "srv":
                f.write(f"_{name}._tcp.{dom}. SRV\n")
            elif kind == "a":
                f.write(f"{name}.{dom}. A\n")
            elif kind == "txt":
                f.write(f"{name}.{dom}. TXT\n")
            else:
                f.write(f"nosuch{n}.{dom}. A\n")
    with open(os.path.join(a.outdir, "check.txt"), "w") as f:
        for name in (names[0], names[len(names) // 2], names[-1]):
            f.write(f"_{name}._tcp.{dom}. SRV\n{name}.{dom}. A\n{name}.{dom}. TXT\n")
        f.write(f"nosuch.{dom}. A\n{names[0]}.{dom}. AAAA\n")
    fill = f"; filler {nfill} instances in {a.fill_services} services (koder-dns only)" if nfill else ""
    print(f"{len(insts)} instances in {len(names)} services; {a.queries} queries; mix {a.mix}{fill}")


if __name__ == "__main__":
    main()
