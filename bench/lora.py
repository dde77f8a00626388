"""LoRA against full fine-tuning: step time and peak memory of the same toy-task run, each in a fresh process.

    python scripts/make_tiny_model.py out/gpt2-25m --n-layer 8 --n-embd 512
    python bench/lora.py --model out/gpt2-25m --steps 6 -- --batch-size 16 --group-size 4 --max-new-tokens 16

Runs train_lean.py --task toy twice (--lora-rank 0, then --lora-rank R), with a KL term so that full
fine-tuning holds its reference copy; prints one table row per run: the median step_time_s over the steps
after the first, and the process's peak RSS (the records' rss_peak_mb, the largest) and its RSS after the
last step (rss_mb), and the trainable share LoRA's start-up line reports. Needs peft.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "train_lean.py")


def run(model: str, steps: int, rank: int, extra: list, out: str) -> dict:
    cmd = [sys.executable, TRAIN, "--model", model, "--task", "toy", "--steps", str(steps), "--kl-coef", "0.02",
           "--eval-interval", "0", "--save-final", "false", "--lora-rank", str(rank), "--out-dir", out, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    share = next((line.split("LoRA rank", 1)[1].split(": ", 1)[1].split(";")[0] for line in proc.stdout.splitlines()
                  if "LoRA rank" in line), "every parameter")   # the header's lora row
    return {"run": f"--lora-rank {rank}" if rank else "full fine-tuning", "trains": share,
            "step_s": statistics.median(r["step_time_s"] for r in recs[1:]),
            "peak_rss_mb": max(r.get("rss_peak_mb", r["rss_mb"]) for r in recs), "rss_mb": recs[-1]["rss_mb"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("extra", nargs="*", help="more train_lean.py flags, after --")
    args = p.parse_args(argv)
    rows = []
    for rank in (0, args.rank):
        with tempfile.TemporaryDirectory() as out:
            rows.append(run(args.model, args.steps, rank, args.extra, out))
    print("| run | trains | step s (median, steps 2+) | peak RSS MB | RSS after the last step MB |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['trains']} | {r['step_s']:.3f} | {r['peak_rss_mb']:,.0f} | {r['rss_mb']:,.0f} |")


if __name__ == "__main__":
    main()
