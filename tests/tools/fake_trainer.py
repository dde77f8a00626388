"""A stand-in for train_lean.py that only writes the log: monitor_memory.py's watch mode is tested
with it in a fraction of a second, and with series whose leak is known exactly.

    fake_trainer.py --steps N --log-file F [--batch-size B] [--leak-mb MB] [--fail-at STEP]
                    [--interrupted-marker FILE] [--oom-above B] [--hold-mb-above B]

Writes one record per step with rss_mb = 800 + leak_mb * step + noise (seeded), rss_peak_mb =
100 + 10 * batch_size (so a sweep's fit is known exactly), and an eval record every 10 steps that
the monitor must ignore. On SIGINT it writes the marker file and exits 0, like a trainer that stops
cleanly. --fail-at makes it crash with exit code 1 at that step; --oom-above makes a larger batch
fail as PyTorch does on CUDA; --hold-mb-above makes a larger batch really hold 400 MB of RAM
for up to a minute, for the sweep's guard to kill.
"""
import argparse
import json
import os
import random
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--log-file", required=True)
p.add_argument("--leak-mb", type=float, default=0.0)
p.add_argument("--fail-at", type=int)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--interrupted-marker")
p.add_argument("--oom-above", type=int)
p.add_argument("--hold-mb-above", type=int)
p.add_argument("--out-dir")                 # accepted like the real trainer's; nothing else is written
p.add_argument("--overwrite", nargs="?", const="true")
p.add_argument("--group-size", type=int)
p.add_argument("--device")
args = p.parse_args()


def on_sigint(signum, frame):
    if args.interrupted_marker:
        with open(args.interrupted_marker, "w") as f:
            f.write("stopped by SIGINT\n")
    sys.exit(0)


signal.signal(signal.SIGINT, on_sigint)
rng = random.Random(0)
if args.oom_above is not None and args.batch_size > args.oom_above:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
    sys.exit(1)
if args.hold_mb_above is not None and args.batch_size > args.hold_mb_above:
    held = bytearray(b"x" * (400 * 2**20))  # written, so every page counts in RSS
    time.sleep(60)
os.makedirs(os.path.dirname(os.path.abspath(args.log_file)), exist_ok=True)
with open(args.log_file, "w") as log:
    for step in range(1, args.steps + 1):
        if step == args.fail_at:
            print("RuntimeError: simulated crash", file=sys.stderr)
            sys.exit(1)
        rec = {"step": step, "loss": 0.1, "step_time_s": 0.01, "samples_per_s": 100.0 * args.batch_size,
               "rss_mb": 800.0 + args.leak_mb * step + rng.gauss(0, 2.0),
               "rss_peak_mb": 100.0 + 10.0 * args.batch_size}
        log.write(json.dumps(rec) + "\n")
        if step % 10 == 0:
            log.write(json.dumps({"kind": "eval", "step": step, "rss_mb": 99999.0}) + "\n")
        log.flush()
        time.sleep(args.sleep)
