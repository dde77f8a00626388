"""Time both test tiers on a fresh clone, as a new user runs them: `make test-fast`, then
`make test`.
Prints each tier's wall time and pytest's summary with the machine, the date and the commit, in the
form the README and BENCHMARKS.md quote.

    python scripts/time_tests.py                # a clone of this repository's HEAD, its own .venv
    python scripts/time_tests.py --venv .venv   # reuse an installed venv (offline machines)
    python scripts/time_tests.py --tier fast    # only `make test-fast`

The clone is made in a temporary folder (--workdir to choose one) with `shared` beside it when this
repository has one (the tests that read ../shared/data run, as they do here). Without --venv, the
clone's `make` installs its .venv first: that set-up is timed apart, not in the tiers' times. Commit
first: the clone holds HEAD, not the working tree. A quiet machine gives the numbers to quote; the
load average before and after each tier is printed so that a busy one shows.
"""
import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = {"fast": "test-fast", "full": "test"}


def machine() -> str:
    """The CPU's model name, its vCPUs, its memory and the load: what a time depends on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
        model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M).group(1).strip()
        flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.M).group(1).split()
        model += ", AVX-512" if "avx512f" in flags else ", AVX2 only" if "avx2" in flags else ""
    except (OSError, AttributeError):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} vCPUs, {memory:.0f} GiB"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def fresh_clone(workdir: str) -> str:
    """A clone of this repository's HEAD in workdir/lean-grpo, with ../shared linked when REPO has
    one."""
    clone = os.path.join(workdir, "lean-grpo")
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", REPO, clone], check=True)
    shared = os.path.join(os.path.dirname(REPO), "shared")
    if os.path.isdir(shared):
        os.symlink(shared, os.path.join(workdir, "shared"))
    return clone


def run_tier(clone: str, target: str, make_flags: list) -> tuple:
    """(wall seconds, exit code, pytest's last line) of `make TARGET` in the clone."""
    start = time.perf_counter()
    proc = subprocess.run(["make", *make_flags, target], cwd=clone, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if " in " in line and (
        "passed" in line or "failed" in line or "error" in line)), "(no pytest summary)")
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    return seconds, proc.returncode, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", help="an installed venv to use as the clone's .venv (not "
                                       "reinstalled)")
    parser.add_argument("--tier", choices=["fast", "full", "both"], default="both")
    parser.add_argument("--workdir", help="where to clone (default: a temporary folder, removed "
                                          "after)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="time-tests-")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    try:
        clone = fresh_clone(workdir)
        make_flags = []
        if args.venv:   # as it is: make must not install into it (its stamps are the clone's)
            os.symlink(os.path.abspath(args.venv), os.path.join(clone, ".venv"))
            make_flags = ["-o", ".venv/.installed", "-o", ".venv/.installed-test"]
        else:
            start = time.perf_counter()
            subprocess.run(["make", ".venv/.installed-test"], cwd=clone, check=True)
            print(f"set-up (.venv from requirements*.txt, not in the times below): "
                  f"{clock(time.perf_counter() - start)}")
        print(f"machine: {machine()}")
        now = datetime.datetime.now(datetime.timezone.utc)
        print(f"commit {commit}, {now:%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}")
        failed = 0
        for tier in (["fast", "full"] if args.tier == "both" else [args.tier]):
            before = load()
            seconds, code, summary = run_tier(clone, TIERS[tier], make_flags)
            failed |= code
            print(f"make {TIERS[tier]:<9} {clock(seconds):>13}   {summary}   "
                  f"(load average {before} before, {load()} after){'   FAILED' if code else ''}",
                  flush=True)
        return 1 if failed else 0
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
