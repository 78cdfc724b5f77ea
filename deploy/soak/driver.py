#!/usr/bin/env python3
"""Load and checks of the koder-dns soak test; started by deploy/soak.sh.

Talks only to 127.0.0.1 (the REST port and the DNS port of the server soak.sh started),
standard library only. Every loop is bounded by the soak deadline. Prints a report and
exits 1 on any violation:

  * an HTTP status other than the expected ones (200, and the 410/404 the churn provokes
    on purpose after deregistering), or a connection error;
  * a registrant that lost its lease (410 on its heartbeat), or that is missing from the
    listing or from the SRV answer; a churned instance still listed or answered;
  * a DNS error rcode, or DNS loss above SOAK_DNS_MAX_LOST_PCT;
  * VmRSS of the server growing from the first to the last third of the samples by more
    than SOAK_RSS_GROWTH_PCT percent and SOAK_RSS_GROWTH_MIB MiB; open descriptors growing.
"""

import collections
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time


def env_int(name, default):
    return int(os.environ.get(name, default))


def env_float(name, default):
    return float(os.environ.get(name, default))


HOST = "127.0.0.1"
HTTP_PORT = env_int("SOAK_HTTP_PORT", 0)
DNS_PORT = env_int("SOAK_DNS_PORT", 0)
API_KEY = os.environ["SOAK_API_KEY"]
PID = env_int("SOAK_SERVER_PID", 0)
WORKDIR = os.environ.get("SOAK_WORKDIR", "/tmp")
SECONDS = env_float("SOAK_SECONDS", 60)
REGISTRANTS = env_int("SOAK_REGISTRANTS", 200)
TTL = env_float("SOAK_TTL_SECONDS", 5)
HEARTBEAT = env_float("SOAK_HEARTBEAT_SECONDS", 1)
REG_THREADS = max(1, min(env_int("SOAK_REGISTRANT_THREADS", 10), REGISTRANTS))
CHURN_WORKERS = env_int("SOAK_CHURN_WORKERS", 2)
CHURN_PAUSE = env_float("SOAK_CHURN_PAUSE_SECONDS", 0.005)
CHURN_ABANDON = env_float("SOAK_CHURN_ABANDON_FRACTION", 0.1)
ABANDON_TTL = env_float("SOAK_CHURN_ABANDON_TTL_SECONDS", 2)
REAPER = env_float("SOAK_REAPER_SECONDS", 1)
SAMPLE = env_float("SOAK_SAMPLE_SECONDS", 3)
DNS_QPS = env_int("SOAK_DNS_QPS", 2000)
DNS_MAX_LOST_PCT = env_float("SOAK_DNS_MAX_LOST_PCT", 0.1)
RSS_GROWTH_PCT = env_float("SOAK_RSS_GROWTH_PCT", 10)
RSS_GROWTH_MIB = env_float("SOAK_RSS_GROWTH_MIB", 4)
ZONE = "service.koder"
SERVICE = "reg"
CHURN = "churn"
BASE_PORT = 20000

STOP = threading.Event()        # end of the load phase
STOP_BEATS = threading.Event()  # registrants stop heart-beating (after the final checks)
DEADLINE = time.monotonic() + SECONDS + 120  # hard bound on every loop


def on_signal(signum, _frame):
    STOP.set()
    STOP_BEATS.set()
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = collections.Counter()       # (endpoint, status) -> n
        self.expected = collections.Counter()     # (endpoint, status) -> n, non-200 provoked on purpose
        self.latency = collections.defaultdict(list)
        self.violations = []

    def violation(self, message):
        with self.lock:
            if len(self.violations) < 10000:
                self.violations.append(message)

    def record(self, endpoint, status, seconds, expected):
        with self.lock:
            self.status[(endpoint, status)] += 1
            if status != 200 and status in expected:
                self.expected[(endpoint, status)] += 1
            lat = self.latency[endpoint]
            if len(lat) < 2_000_000:
                lat.append(seconds)


STATS = Stats()


class Api:
    """One keep-alive connection per thread."""

    def __init__(self):
        self.conn = None

    def call(self, method, path, body=None, expect=(200,), endpoint=None):
        endpoint = endpoint or path.split("?")[0].rsplit("/", 1)[-1]
        data = json.dumps(body).encode() if body is not None else None
        headers = {"X-API-Key": API_KEY}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(HOST, HTTP_PORT, timeout=10)
            start = time.monotonic()
            try:
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self.conn.close()
                self.conn = None
                # A keep-alive connection the server closed between requests: retry once on
                # a fresh one; anything else is an error.
                if attempt == 1 and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
                    continue
                STATS.record(endpoint, "conn-error", time.monotonic() - start, expect)
                STATS.violation(f"{method} {path}: {type(e).__name__}: {e}")
                return None, None
            elapsed = time.monotonic() - start
            STATS.record(endpoint, resp.status, elapsed, expect)
            if resp.status not in expect:
                STATS.violation(f"{method} {path} {body}: HTTP {resp.status} {raw[:200]!r}")
            try:
                return resp.status, json.loads(raw) if raw else None
            except ValueError:
                STATS.violation(f"{method} {path}: HTTP {resp.status} body is not JSON: {raw[:200]!r}")
                return resp.status, None
        return None, None


# ---------------------------------------------------------------------------------------
# DNS, by hand
# ---------------------------------------------------------------------------------------

TYPES = {"A": 1, "TXT": 16, "AAAA": 28, "SRV": 33, "SOA": 6}


def dns_query(qid, name, qtype, edns=None):
    labels = b"".join(bytes([len(l)]) + l.encode() for l in name.strip(".").split("."))
    msg = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 1 if edns else 0) + labels + b"\0"
    msg += struct.pack(">HH", TYPES[qtype], 1)
    if edns:
        msg += b"\0" + struct.pack(">HHIH", 41, edns, 0, 0)
    return msg


def dns_header(reply):
    qid, flags, qd, an, ns, ar = struct.unpack(">HHHHHH", reply[:12])
    return {"id": qid, "rcode": flags & 0xF, "tc": bool(flags & 0x0200), "qr": bool(flags & 0x8000),
            "an": an, "ns": ns, "ar": ar}


def recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def dns_tcp(name, qtype):
    qid = random.randrange(65536)
    msg = dns_query(qid, name, qtype)
    with socket.create_connection((HOST, DNS_PORT), timeout=5) as s:
        s.sendall(struct.pack(">H", len(msg)) + msg)
        (length,) = struct.unpack(">H", recv_exact(s, 2))
        reply = recv_exact(s, length)
    h = dns_header(reply)
    if h["id"] != qid or not h["qr"]:
        raise ValueError(f"bad reply header {h}")
    return h


def dns_udp(name, qtype, edns=None):
    qid = random.randrange(65536)
    msg = dns_query(qid, name, qtype, edns)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(msg, (HOST, DNS_PORT))
        reply, _ = s.recvfrom(65535)
    h = dns_header(reply)
    limit = edns or 512
    if h["id"] != qid or not h["qr"] or len(reply) > limit:
        raise ValueError(f"bad reply {h}, {len(reply)} bytes for a {limit}-byte payload")
    return h


class DnsChecks:
    """Every second during the load: the SRV answer over TCP has every registrant (never one
    fewer: nothing is lost while it heart-beats), and UDP answers are sane."""

    def __init__(self):
        self.queries = 0
        self.mismatch = 0
        self.errors = 0
        self.rcodes = collections.Counter()

    def run(self):
        srv = f"_{SERVICE}._tcp.{ZONE}"
        while not STOP.is_set() and time.monotonic() < DEADLINE:
            for proto, name, qtype, edns in (("tcp", srv, "SRV", None), ("udp", srv, "SRV", 1232),
                                             ("udp", f"{SERVICE}.{ZONE}", "A", None), ("udp", ZONE, "SOA", None)):
                try:
                    h = dns_tcp(name, qtype) if proto == "tcp" else dns_udp(name, qtype, edns)
                except (OSError, ValueError) as e:
                    self.errors += 1
                    STATS.violation(f"DNS {proto} {qtype} {name}: {e}")
                    continue
                self.queries += 1
                self.rcodes[h["rcode"]] += 1
                if h["rcode"] != 0:
                    STATS.violation(f"DNS {proto} {qtype} {name}: rcode {h['rcode']}")
                if proto == "tcp" and h["an"] != REGISTRANTS:
                    self.mismatch += 1
                    STATS.violation(f"DNS SRV over TCP has {h['an']} answers, want {REGISTRANTS}")
            STOP.wait(1.0)


def dig(*args):
    out = subprocess.run(["dig", f"@{HOST}", "-p", str(DNS_PORT), "+tries=1", "+time=3", *args],
                         capture_output=True, text=True, timeout=15)
    return out.stdout


def dig_loop(stats):
    """Fallback load when dnsperf is missing: dig in a loop."""
    names = [(f"_{SERVICE}._tcp.{ZONE}", "SRV"), (f"{SERVICE}.{ZONE}", "A"), (ZONE, "SOA"), (f"nope.{ZONE}", "A")]
    while not STOP.is_set() and time.monotonic() < DEADLINE:
        name, qtype = random.choice(names)
        text = dig("+tcp" if random.random() < 0.5 else "+notcp", qtype, name)
        m = re.search(r"status: (\w+)", text)
        stats[m.group(1) if m else "no-reply"] += 1


def dnsperf(seconds):
    """UDP load with dnsperf, rate-limited so the 2-core box stays usable."""
    data = os.path.join(WORKDIR, "dnsperf.queries")
    with open(data, "w") as f:
        for line in [f"_{SERVICE}._tcp.{ZONE} SRV", f"{SERVICE}.{ZONE} A", f"{SERVICE}.{ZONE} TXT",
                     f"{ZONE} SOA", f"{ZONE} NS", f"ns.{ZONE} A", f"7f000001.addr.{ZONE} A",
                     f"_tcp.{ZONE} A", "www.koder.dev A", "koder.dev MX"]:
            f.write(line + "\n")
    cmd = ["dnsperf", "-s", HOST, "-p", str(DNS_PORT), "-d", data, "-l", str(int(seconds)), "-c", "4",
           "-T", "1", "-Q", str(DNS_QPS), "-t", "2", "-q", "64"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def parse_dnsperf(text):
    out = {}
    for key, pat in [("sent", r"Queries sent:\s+(\d+)"), ("completed", r"Queries completed:\s+(\d+)"),
                     ("lost", r"Queries lost:\s+(\d+)"), ("qps", r"Queries per second:\s+([\d.]+)"),
                     ("latency_avg_s", r"Average Latency \(s\):\s+([\d.]+)")]:
        m = re.search(pat, text)
        if m:
            out[key] = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    m = re.search(r"Response codes:\s+(.*)", text)
    out["rcodes"] = dict((c, int(n)) for c, n in re.findall(r"(\w+) (\d+) \(", m.group(1))) if m else {}
    return out


# ---------------------------------------------------------------------------------------
# Registrants and churn
# ---------------------------------------------------------------------------------------

def registrant_id(i):
    return f"reg-{i:04d}"


def registration(i):
    return {"id": registrant_id(i), "name": SERVICE, "address": HOST, "port": BASE_PORT + i,
            "ttl_ns": int(TTL * 1e9)}


class Registrants:
    def __init__(self):
        self.registered = threading.Barrier(REG_THREADS + 1)
        self.lost = 0
        self.beats = 0
        self.late = 0          # heartbeats sent more than one period after they were due
        self.max_lag = 0.0
        self.lock = threading.Lock()

    def run(self, t):
        api = Api()
        mine = list(range(t, REGISTRANTS, REG_THREADS))
        for i in mine:
            api.call("POST", "/api/v1/services/register", registration(i))
        self.registered.wait()
        # Spread each thread's beats over the period.
        start = time.monotonic()
        due = {i: start + HEARTBEAT * (k + 1) / len(mine) for k, i in enumerate(mine)}
        while not STOP_BEATS.is_set() and time.monotonic() < DEADLINE:
            i = min(due, key=due.get)
            wait = due[i] - time.monotonic()
            if wait > 0 and STOP_BEATS.wait(wait):
                break
            lag = time.monotonic() - due[i]
            status, _ = api.call("POST", "/api/v1/services/heartbeat", {"id": registrant_id(i)})
            with self.lock:
                self.beats += 1
                self.max_lag = max(self.max_lag, lag)
                if lag > HEARTBEAT:
                    self.late += 1
            if status == 410:
                # Counted as a violation by Api (410 is not expected here): the lease ran
                # out although the registrant kept beating. Re-register, as a client would.
                with self.lock:
                    self.lost += 1
                api.call("POST", "/api/v1/services/register", registration(i))
            due[i] += HEARTBEAT


class Churn:
    def __init__(self):
        self.cycles = 0
        self.abandoned = 0
        self.last_abandon_expiry = 0.0
        self.lock = threading.Lock()

    def run(self, w):
        api = Api()
        n = 0
        rnd = random.Random(w)
        while not STOP.is_set() and time.monotonic() < DEADLINE:
            n += 1
            cid = f"churn-{w}-{n}"
            abandon = rnd.random() < CHURN_ABANDON
            body = {"id": cid, "name": CHURN, "address": HOST, "port": 30000 + (n % 30000),
                    "protocol": "tcp" if n % 2 else "udp", "tags": [f"n={n}"], "metadata": {"w": str(w)},
                    "ttl_ns": int((ABANDON_TTL if abandon else TTL) * 1e9)}
            api.call("POST", "/api/v1/services/register", body)
            if abandon:
                # Left to expire: the reaper must remove it.
                with self.lock:
                    self.abandoned += 1
                    self.last_abandon_expiry = time.monotonic() + ABANDON_TTL
            else:
                api.call("POST", "/api/v1/services/heartbeat", {"id": cid})
                api.call("POST", "/api/v1/services/deregister", {"id": cid})
                # Gone at once: a heartbeat gets 410, a second deregister 404.
                api.call("POST", "/api/v1/services/heartbeat", {"id": cid}, expect=(410,))
                api.call("POST", "/api/v1/services/deregister", {"id": cid}, expect=(404,))
            with self.lock:
                self.cycles += 1
            if CHURN_PAUSE:
                STOP.wait(CHURN_PAUSE)


# ---------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------

def proc_status(field):
    with open(f"/proc/{PID}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


class Sampler:
    def __init__(self):
        self.samples = []  # (t, rss_kib, fds, threads)

    def sample(self, t0):
        try:
            rss = proc_status("VmRSS")
            threads = proc_status("Threads")
            fds = len(os.listdir(f"/proc/{PID}/fd"))
        except OSError as e:
            STATS.violation(f"the server process is gone: {e}")
            STOP.set()
            return
        self.samples.append((time.monotonic() - t0, rss, fds, threads))

    def run(self, t0):
        while not STOP.is_set() and time.monotonic() < DEADLINE:
            self.sample(t0)
            STOP.wait(SAMPLE)
        self.sample(t0)


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def pct(xs, p):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main():
    print(f"soak: {REGISTRANTS} registrants (TTL {TTL:g}s, heartbeat every {HEARTBEAT:g}s), "
          f"{CHURN_WORKERS} churn workers, DNS load for {SECONDS:g}s; server pid {PID}, "
          f"http 127.0.0.1:{HTTP_PORT}, dns 127.0.0.1:{DNS_PORT}", flush=True)
    threads = []
    regs = Registrants()
    for t in range(REG_THREADS):
        threads.append(threading.Thread(target=regs.run, args=(t,), daemon=True))
    for th in threads:
        th.start()
    t_reg = time.monotonic()
    regs.registered.wait(timeout=120)
    print(f"soak: {REGISTRANTS} registrants registered in {time.monotonic() - t_reg:.2f}s", flush=True)

    # Let the allocator settle on the steady state before the first memory sample.
    time.sleep(min(2.0, SECONDS / 10))
    t0 = time.monotonic()
    churn = Churn()
    checks = DnsChecks()
    sampler = Sampler()
    load = [threading.Thread(target=churn.run, args=(w,), daemon=True) for w in range(CHURN_WORKERS)]
    load.append(threading.Thread(target=checks.run, daemon=True))
    load.append(threading.Thread(target=sampler.run, args=(t0,), daemon=True))
    perf = dnsperf(SECONDS) if shutil.which("dnsperf") else None
    dig_stats = collections.Counter()
    if perf is None:
        print("soak: dnsperf not found; DNS load is dig in a loop", flush=True)
        load.append(threading.Thread(target=dig_loop, args=(dig_stats,), daemon=True))
    for th in load:
        th.start()
    try:
        while time.monotonic() - t0 < SECONDS and not STOP.is_set():
            time.sleep(0.2)
    finally:
        STOP.set()
    perf_out = ""
    if perf is not None:
        try:
            perf_out, _ = perf.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            perf.kill()
            perf_out, _ = perf.communicate()
    for th in load:
        th.join(timeout=15)
    load_seconds = time.monotonic() - t0

    # Leak check: wait out the abandoned leases and one reaper pass, while the registrants
    # keep beating, then everything churned must be gone and every registrant present.
    settle = max(0.0, churn.last_abandon_expiry - time.monotonic()) + REAPER + 1.0
    time.sleep(settle)
    api = Api()
    _, listing = api.call("GET", "/api/v1/services?detail=1", endpoint="list")
    instances = (listing or {}).get("instances", [])
    ids = {i["id"] for i in instances}
    want = {registrant_id(i) for i in range(REGISTRANTS)}
    missing = sorted(want - ids)
    leaked = sorted(i for i in ids if i not in want)
    if missing:
        STATS.violation(f"{len(missing)} registrants not listed: {missing[:10]}")
    if leaked:
        STATS.violation(f"{len(leaked)} churned instances still listed: {leaked[:10]}")
    _, names = api.call("GET", "/api/v1/services", endpoint="list")
    if (names or {}).get("services") != [SERVICE]:
        STATS.violation(f"service names {names}, want [{SERVICE!r}]")
    srv_text = dig("+tcp", "+short", "SRV", f"_{SERVICE}._tcp.{ZONE}")
    srv_ports = {int(line.split()[2]) for line in srv_text.splitlines() if len(line.split()) == 4}
    want_ports = {BASE_PORT + i for i in range(REGISTRANTS)}
    if srv_ports != want_ports:
        STATS.violation(f"SRV answers {len(srv_ports)} registrants, want {REGISTRANTS}; "
                        f"missing ports {sorted(want_ports - srv_ports)[:10]}, extra {sorted(srv_ports - want_ports)[:10]}")
    churn_status = {}
    for proto in ("tcp", "udp"):
        text = dig("+tcp", "SRV", f"_{CHURN}._{proto}.{ZONE}")
        m = re.search(r"status: (\w+)", text)
        churn_status[proto] = m.group(1) if m else "no-reply"
        if churn_status[proto] != "NXDOMAIN":
            STATS.violation(f"_{CHURN}._{proto}.{ZONE} SRV is {churn_status[proto]}, want NXDOMAIN (leaked)")

    # The end: registrants stop and deregister; the registry must be empty.
    STOP_BEATS.set()
    for th in threads:
        th.join(timeout=15)
    for i in range(REGISTRANTS):
        api.call("POST", "/api/v1/services/deregister", {"id": registrant_id(i)})
    _, listing = api.call("GET", "/api/v1/services?detail=1", endpoint="list")
    left = len((listing or {}).get("instances", []))
    if left:
        STATS.violation(f"{left} instances listed after every registrant deregistered")
    after = dig("+tcp", "SRV", f"_{SERVICE}._tcp.{ZONE}")
    m = re.search(r"status: (\w+)", after)
    end_status = m.group(1) if m else "no-reply"
    if end_status != "NXDOMAIN":
        STATS.violation(f"_{SERVICE}._tcp SRV is {end_status} after every registrant deregistered")

    # ---------------------------------------------------------------- report
    print()
    print(f"== load phase: {load_seconds:.1f}s")
    print(f"registrants: {REGISTRANTS}, heartbeats {regs.beats} ({regs.beats / max(load_seconds, 1e-9):.0f}/s), "
          f"lost leases (410) {regs.lost}, late beats {regs.late}, max beat lag {regs.max_lag * 1000:.0f} ms")
    print(f"churn: {churn.cycles} cycles ({churn.cycles / max(load_seconds, 1e-9):.0f}/s), "
          f"{churn.abandoned} left to expire, settle wait {settle:.1f}s")
    print("\n== HTTP responses by endpoint and status (expected non-200 in brackets)")
    endpoints = sorted({e for e, _ in STATS.status})
    for e in endpoints:
        parts = []
        for (ep, st), n in sorted(STATS.status.items(), key=lambda kv: str(kv[0][1])):
            if ep == e:
                exp = STATS.expected.get((ep, st), 0)
                parts.append(f"{st}: {n}" + (f" [{exp} expected]" if exp else ""))
        lat = STATS.latency[e]
        print(f"  {e:<12} {', '.join(parts):<50} p50 {pct(lat, 50) * 1000:.2f} ms  p99 {pct(lat, 99) * 1000:.2f} ms  "
              f"max {max(lat, default=0) * 1000:.1f} ms")
    unexpected = sum(n - STATS.expected.get((e, st), 0) for (e, st), n in STATS.status.items() if st != 200)
    print(f"  unexpected non-200 responses: {unexpected}")

    print("\n== DNS")
    print(f"  checker (SRV over TCP must hold all {REGISTRANTS}): {checks.queries} queries, "
          f"{checks.mismatch} short answers, {checks.errors} errors, rcodes {dict(checks.rcodes)}")
    if perf is not None:
        d = parse_dnsperf(perf_out)
        print(f"  dnsperf (UDP, {DNS_QPS} qps cap): sent {d.get('sent')}, completed {d.get('completed')}, "
              f"lost {d.get('lost')}, rcodes {d.get('rcodes')}, {d.get('qps')} qps, avg latency {d.get('latency_avg_s')} s")
        if perf.returncode != 0 or "sent" not in d:
            STATS.violation(f"dnsperf failed (exit {perf.returncode}): {perf_out[-500:]}")
        else:
            bad = {c: n for c, n in d["rcodes"].items() if c not in ("NOERROR", "NXDOMAIN")}
            if bad:
                STATS.violation(f"dnsperf saw error rcodes {bad}")
            # The query file holds no name that should be NXDOMAIN.
            if d["rcodes"].get("NXDOMAIN"):
                STATS.violation(f"dnsperf saw {d['rcodes']['NXDOMAIN']} NXDOMAIN for names that exist")
            lost_pct = 100.0 * d.get("lost", 0) / max(d["sent"], 1)
            if lost_pct > DNS_MAX_LOST_PCT:
                STATS.violation(f"dnsperf lost {lost_pct:.3f}% of queries (limit {DNS_MAX_LOST_PCT}%)")
    else:
        print(f"  dig loop: {dict(dig_stats)}")
        bad = {c: n for c, n in dig_stats.items() if c not in ("NOERROR", "NXDOMAIN")}
        if bad:
            STATS.violation(f"dig saw {bad}")
    print(f"  at the end: SRV over TCP listed {len(srv_ports)}/{REGISTRANTS} registrants; "
          f"churn SRV {churn_status}; after deregistering all: {end_status}, {left} listed")

    print(f"\n== memory (VmRSS of pid {PID}, sampled every {SAMPLE:g}s)")
    s = sampler.samples
    print("  t(s)  " + " ".join(f"{t:6.0f}" for t, *_ in s))
    print("  MiB   " + " ".join(f"{rss / 1024:6.1f}" for _, rss, *_ in s))
    print("  fds   " + " ".join(f"{fd:6d}" for _, _, fd, _ in s))
    if len(s) >= 3:
        third = max(1, len(s) // 3)
        first = mean([rss for _, rss, *_ in s[:third]]) / 1024
        last = mean([rss for _, rss, *_ in s[-third:]]) / 1024
        growth = last - first
        growth_pct = 100.0 * growth / first if first else 0.0
        print(f"  first third mean {first:.1f} MiB, last third mean {last:.1f} MiB, "
              f"growth {growth:+.1f} MiB ({growth_pct:+.1f}%); peak {max(r for _, r, *_ in s) / 1024:.1f} MiB; "
              f"limit {RSS_GROWTH_PCT:g}% and {RSS_GROWTH_MIB:g} MiB")
        if growth > RSS_GROWTH_MIB and growth_pct > RSS_GROWTH_PCT:
            STATS.violation(f"VmRSS grew {growth:+.1f} MiB ({growth_pct:+.1f}%) from the first to the last third")
        fd_first = mean([fd for _, _, fd, _ in s[:third]])
        fd_last = mean([fd for _, _, fd, _ in s[-third:]])
        print(f"  open fds: first third mean {fd_first:.1f}, last third mean {fd_last:.1f}; "
              f"threads {s[0][3]} -> {s[-1][3]}")
        if fd_last > fd_first + 16:
            STATS.violation(f"open descriptors grew from {fd_first:.0f} to {fd_last:.0f}")
    else:
        STATS.violation(f"only {len(s)} memory samples; run longer than {SAMPLE * 3:g}s")

    print()
    if STATS.violations:
        print(f"FAIL: {len(STATS.violations)} violations; first ones:")
        for v in STATS.violations[:20]:
            print(f"  - {v}")
        return 1
    print("PASS: no unexpected responses, nothing lost, nothing leaked, memory flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
