"""A wedged UCI engine: it completes the handshake, then never answers a search, and neither the end
of its input nor SIGHUP ends it. Real Stockfish quits when its input closes; this one is ended only
by a kill, so the tests use it where nothing but the parent-death signal or a timeout can end it."""
import signal
import sys
import time

signal.signal(signal.SIGHUP, signal.SIG_IGN)
for line in sys.stdin:
    command = line.split()[:1]
    if command == ["uci"]:
        print("id name silent", "option name Threads type spin default 1 min 1 max 512",
              "option name Hash type spin default 16 min 1 max 33554432",
              "option name MultiPV type spin default 1 min 1 max 500", "uciok", sep="\n", flush=True)
    elif command == ["isready"]:
        print("readyok", flush=True)
    elif command == ["go"]:
        break
while True:
    time.sleep(3600)
