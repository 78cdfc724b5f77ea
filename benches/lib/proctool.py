#!/usr/bin/env python3
"""Small /proc helpers for the benchmark scripts.

  proctool.py cpu PID    -> utime+stime clock ticks of PID and its descendants
"""
import os
import sys


def children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        kids.setdefault(int(rest[1]), []).append(int(d))
    return kids


def tree(pid):
    kids = children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu(pid):
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        total += int(rest[11]) + int(rest[12])  # utime, stime
    return total


if __name__ == "__main__":
    cmd, pid = sys.argv[1], int(sys.argv[2])
    if cmd != "cpu":
        sys.exit(f"proctool.py: unknown command {cmd!r}; the only one is cpu")
    print(cpu(pid))
