#!/usr/bin/env python3
"""Fault phase of the soak test: a koder-dns of its own, under heart-beating registrants and
a writer that registers and deregisters, is alternately stopped (SIGSTOP/SIGCONT) and
killed (SIGKILL, then restarted on the same data directory), each time for longer than the
registrants' TTL. Then it checks what the registry promises:

  * every acknowledged registration is present, every acknowledged deregistration absent,
    nothing that was not acknowledged appears (a request cut by a kill may go either way);
  * no heart-beating registrant ever got 410 (it never stopped beating, only the registry
    did), and every one of them is served again after the last fault.

Prints one figures line and exits 0 when all hold. Settings (environment):
  SOAK_BINARY (required), SOAK_FAULT_WORKDIR (required), SOAK_FAULT_SECONDS=40,
  SOAK_FAULT_REGISTRANTS=50, SOAK_FAULT_TTL_SECONDS=3, SOAK_FAULT_OUTAGE_SECONDS=5.
Only 127.0.0.1 is contacted; the server started here is killed on exit.
"""

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

BINARY = os.environ["SOAK_BINARY"]
WORK = os.environ["SOAK_FAULT_WORKDIR"]
SECONDS = float(os.environ.get("SOAK_FAULT_SECONDS", "40"))
REGISTRANTS = int(os.environ.get("SOAK_FAULT_REGISTRANTS", "50"))
TTL = float(os.environ.get("SOAK_FAULT_TTL_SECONDS", "3"))
OUTAGE = float(os.environ.get("SOAK_FAULT_OUTAGE_SECONDS", "5"))
HEARTBEAT = TTL / 3
KEY = "soak-faults-" + os.urandom(8).hex()
HOST = "127.0.0.1"


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


HTTP_PORT, DNS_PORT = free_port(), free_port()
stop = threading.Event()
server = None
server_log = open(os.path.join(WORK, "server.log"), "ab")


def start_server():
    global server
    server = subprocess.Popen(
        [BINARY, "serve", "--http-listen", f"{HOST}:{HTTP_PORT}", "--dns-listen", f"{HOST}:{DNS_PORT}",
         "--data-dir", os.path.join(WORK, "data"), "--zones-dir", os.path.join(WORK, "zones")],
        env={**os.environ, "KODER_DNS_API_KEY": KEY, "KODER_DNS_LOG": os.environ.get("KODER_DNS_LOG", "warn")},
        stdout=server_log, stderr=server_log)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection(HOST, HTTP_PORT, timeout=1)
            c.request("GET", "/healthz")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        if server.poll() is not None:
            sys.exit(f"faults: the server exited with {server.returncode}; see {WORK}/server.log")
        time.sleep(0.05)
    sys.exit("faults: the server did not come up within 20s")


def call(path, body, timeout=15):
    """(status, json) or None when the connection failed (server down or killed mid-request)."""
    try:
        c = http.client.HTTPConnection(HOST, HTTP_PORT, timeout=timeout)
        c.request("POST" if body is not None else "GET", path,
                  body=json.dumps(body) if body is not None else None,
                  headers={"X-API-Key": KEY, "Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, (json.loads(data) if data else None)
    except (OSError, http.client.HTTPException, ValueError):
        return None


def registrant_body(i):
    return {"id": f"beat-{i:04d}", "name": "faults", "address": f"10.77.{i // 250}.{i % 250 + 1}",
            "port": 7000, "ttl_ns": int(TTL * 1e9)}


lock = threading.Lock()
lost = []          # registrant ids that got 410
acked = set()      # writer ids acknowledged as registered (and not since deregistered)
removed = set()    # writer ids acknowledged as deregistered
uncertain = set()  # writer ids whose request was cut by a fault
counts = {"registered": 0, "deregistered": 0, "cut": 0, "heartbeats": 0}


def registrant(i):
    body = registrant_body(i)
    while not stop.is_set():
        r = call("/api/v1/services/register", body)
        if r and r[0] == 200:
            break
        time.sleep(0.2)
    while not stop.is_set():
        r = call("/api/v1/services/heartbeat", {"id": body["id"]})
        if r is None:
            time.sleep(0.1)  # down: try again soon
            continue
        with lock:
            counts["heartbeats"] += 1
            if r[0] == 410:
                lost.append(body["id"])
        if r[0] == 410:
            call("/api/v1/services/register", body)
        stop.wait(HEARTBEAT * random.uniform(0.9, 1.1))


def writer():
    i = 0
    while not stop.is_set():
        wid = f"w-{i:06d}"
        i += 1
        r = call("/api/v1/services/register",
                 {"id": wid, "name": "writes", "address": "10.78.0.1", "port": 1 + i % 60000, "ttl_ns": 3600 * 10**9})
        with lock:
            if r is None:
                uncertain.add(wid)
                counts["cut"] += 1
            elif r[0] == 200:
                acked.add(wid)
                counts["registered"] += 1
        if r is None:
            time.sleep(0.1)
            continue
        if i % 3 == 0 and acked:
            with lock:
                victim = random.choice(sorted(acked)[-50:])
            r = call("/api/v1/services/deregister", {"id": victim})
            with lock:
                if r is None:
                    acked.discard(victim)
                    uncertain.add(victim)
                    counts["cut"] += 1
                elif r[0] == 200:
                    acked.discard(victim)
                    removed.add(victim)
                    counts["deregistered"] += 1


def listing(query):
    r = call(f"/api/v1/services?detail=1{query}", None)
    if not r or r[0] != 200:
        sys.exit(f"faults: listing failed: {r}")
    return {i["id"] for i in r[1]["instances"]}


def main():
    os.makedirs(os.path.join(WORK, "zones"), exist_ok=True)
    start_server()
    threads = [threading.Thread(target=registrant, args=(i,), daemon=True) for i in range(REGISTRANTS)]
    threads.append(threading.Thread(target=writer, daemon=True))
    for t in threads:
        t.start()
    time.sleep(2 * HEARTBEAT)
    stalls = kills = 0
    t_end = time.time() + SECONDS
    while time.time() < t_end:
        if (stalls + kills) % 2 == 0:
            server.send_signal(signal.SIGSTOP)
            time.sleep(OUTAGE)
            server.send_signal(signal.SIGCONT)
            stalls += 1
        else:
            server.kill()
            server.wait()
            time.sleep(OUTAGE)
            start_server()
            kills += 1
        time.sleep(3 * HEARTBEAT)
    time.sleep(2 * HEARTBEAT)
    stop.set()
    for t in threads:
        t.join(timeout=20)
    present = listing("")
    healthy = listing("&healthy_only=1")
    with lock:
        missing = sorted(acked - present)
        resurrected = sorted((removed - uncertain) & present)
        ghosts = sorted(i for i in present if i.startswith("w-") and i not in acked and i not in uncertain)
        beating = {registrant_body(i)["id"] for i in range(REGISTRANTS)}
        unserved = sorted(beating - healthy)
        print(f"faults: {SECONDS:.0f}s, {stalls} SIGSTOP and {kills} SIGKILL outages of {OUTAGE:.0f}s "
              f"(TTL {TTL:.0f}s); {counts['registered']} registrations and {counts['deregistered']} "
              f"deregistrations acknowledged, {counts['cut']} unanswered (server down or killed mid-request); acknowledged missing "
              f"{len(missing)}, deregistered present {len(resurrected)}, never acknowledged present "
              f"{len(ghosts)}; {counts['heartbeats']} heartbeats, 410 seen by live registrants "
              f"{len(lost)}; registrants not served at the end {len(unserved)}")
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=15)
    failed = missing or resurrected or ghosts or lost or unserved
    if failed:
        print(f"faults: FAIL missing={missing[:5]} resurrected={resurrected[:5]} ghosts={ghosts[:5]} "
              f"lost={lost[:5]} unserved={unserved[:5]}", file=sys.stderr)
    if server.returncode != 0:
        print(f"faults: FAIL the server exited with {server.returncode} after SIGTERM", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        stop.set()
        if server and server.poll() is None:
            server.send_signal(signal.SIGCONT)
            server.kill()
            server.wait()
