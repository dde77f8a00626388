"""GRPO throughput benchmark: lean-grpo (train_lean.py) vs TRL's GRPOTrainer vs the floor, in one run.

    python bench/run.py --trl-python /path/to/venv-with-trl/bin/python          # tiny model, fp32 + bf16
    python bench/run.py --models tiny,gpt2-124m --dtypes bf16 --rounds 2 --steps 2
    python bench/run.py --models tiny,tiny-llama --dtypes fp32 --threads 1  # GPT-2 vs Llama of equal size

Workload (every system, every step): 8 prompts x 8 completions = 64, chess A: prompts, exactly 144
new tokens per completion (EOS masked while sampling: `--min-new-tokens 144` for ours, the same
`min_new_tokens` generation option for TRL and the floor), KL on (beta 0.02: the reference forward
runs), one optimizer update per step, fp32 weights (bf16: autocast). Each system runs in its own
process for warmup + steps steps; the systems alternate (A B C A B C ...) for --rounds rounds, so
that a noisy neighbour hits all of them alike, and the table reports medians over all measured
steps. It runs on CUDA unchanged (every system then uses the GPU; peak memory is then CUDA's peak
allocated, else the process's peak RSS).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench.common import model_dir, task_flag, weights_per_token  # noqa: E402

SYSTEMS = ("ours", "trl", "floor")
COLUMNS = ("gen_time_s", "score_time_s", "ref_time_s", "train_time_s", "step_time_s")


def command(system, args, model, dtype, n_steps, out, work):
    common = ["--model", model, "--dtype", dtype, "--steps", str(n_steps)]
    if system == "ours":
        script = "train_lean.py" if args.lengths == "fixed" else os.path.join("bench", "varied_ours.py")
        fixed = ["--min-new-tokens", str(args.new_tokens)] if args.lengths == "fixed" else []
        return [sys.executable, os.path.join(REPO, script), *common, "--task", task_flag(args.task),
                "--batch-size", "64", "--group-size", "8", "--max-new-tokens", str(args.new_tokens),
                *fixed, "--kl-coef", "0.02", "--seed", "0",
                "--eval-interval", "0", "--out-dir", work, "--log-file", out, "--log-level", "warning",
                *args.ours_args.split()]
    script = {"trl": "trl_run.py", "floor": "floor_run.py"}[system]
    python = args.trl_python if system == "trl" else sys.executable
    return [python, os.path.join(HERE, script), *common, "--task", args.task,
            "--new-tokens", str(args.new_tokens), "--lengths", args.lengths, "--out", out]


def run_once(system, args, model, dtype, env):
    n_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix=f"bench-{system}-") as work:
        out = os.path.join(work, "steps.jsonl")
        cmd = command(system, args, model, dtype, n_steps, out, work)
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"{system} failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
        with open(out) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "samples_per_s" in r][args.warmup:]  # step records, not evaluations


def summarize(records, batch):
    med = {k: statistics.median(r[k] for r in records) for k in COLUMNS}
    out = {"steps": len(records), "samples_per_s": statistics.median(r["samples_per_s"] for r in records),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records), **med,
           "all_samples_per_s": [round(r["samples_per_s"], 2) for r in records]}
    peak = [r.get("cuda_peak_mb") for r in records if r.get("cuda_peak_mb") is not None]
    out["peak_mb"] = max(peak) if peak else max(r["rss_peak_mb"] for r in records)
    out["peak_kind"] = "cuda peak allocated" if peak else "peak RSS"
    return out


def model_flops_per_step(path, batch=64, new_tokens=144):
    """A lower bound of a step's model FLOPs: 10 N per completion token (2 N sampling, 2 N reference,
    6 N forward + backward), N = the weights a token passes (weights_per_token: GPT-2's 12 L E^2 + head
    V E); prompt tokens and attention left out."""
    return 10 * weights_per_token(path) * batch * new_tokens


def _num(v, digits):
    return "-" if v is None else f"{v:.{digits}f}"


def table(results, systems):
    lines = ["| model | dtype | system | samples/s | tokens/s | vs TRL | generation s | reward s | reference s "
             "| training s | step s | peak MB | model TFLOP/s | MFU | steps |", "|" + "---|" * 15]
    for (model, dtype), by_system in results.items():
        trl = by_system.get("trl", {}).get("samples_per_s")
        for system in systems:
            r = by_system.get(system)
            if r is None:
                continue
            ratio = f"{r['samples_per_s'] / trl:.2f}x" if trl else "-"
            lines.append(f"| {model} | {dtype} | {system} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} "
                         f"| {r['gen_time_s']:.2f} | {r['score_time_s']:.3f} | {r['ref_time_s']:.2f} "
                         f"| {r['train_time_s']:.2f} | {r['step_time_s']:.2f} | {r['peak_mb']:.0f} "
                         f"| {_num(r.get('model_tflops_per_s'), 3)} | {_num(r.get('mfu'), 3)} | {r['steps']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, tiny-llama, gpt2-124m or model folders")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=3, help="A B C rounds per model and dtype")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per system per round")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of each process")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for every system (default: torch's)")
    ap.add_argument("--task", default="chess-a")
    ap.add_argument("--new-tokens", type=int, default=144)
    ap.add_argument("--lengths", choices=["fixed", "varied"], default="fixed",
                    help="fixed: every completion --new-tokens long; varied: each row's length from one "
                         "long-tailed distribution (bench/common.py row_lengths), the same rows for every system")
    ap.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", sys.executable),
                    help="interpreter of a venv with requirements-bench.txt (TRL) [TRL_PYTHON]")
    ap.add_argument("--ours-args", default="", help="extra flags for train_lean.py, e.g. --gradient-checkpointing")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak TFLOP/s for the MFU column (H100 SXM dense bf16: 989)")
    ap.add_argument("--model-root", default=os.path.join(REPO, "out", "bench-models"))
    ap.add_argument("--out", default=os.path.join(REPO, "out", "bench"))
    args = ap.parse_args()

    env = dict(os.environ)
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    env.pop("PYTHONPATH", None)
    systems = [s for s in args.systems.split(",") if s]
    os.makedirs(args.out, exist_ok=True)
    raw, results, failed = {}, {}, {}
    for name in args.models.split(","):
        path = model_dir(name, args.model_root)
        for dtype in args.dtypes.split(","):
            key = (name, dtype)
            raw[key] = {s: [] for s in systems}
            for rnd in range(args.rounds):
                for system in systems:
                    try:
                        recs = run_once(system, args, path, dtype, env)
                    except RuntimeError as e:  # e.g. killed for memory: report it, keep the others
                        print(f"[{name} {dtype} round {rnd + 1}/{args.rounds}] {e}", flush=True)
                        failed.setdefault(key, {})[system] = str(e).splitlines()[0]
                        continue
                    raw[key][system] += recs
                    print(f"[{name} {dtype} round {rnd + 1}/{args.rounds}] {system}: "
                          + " ".join(f"{r['samples_per_s']:.2f}" for r in recs) + " samples/s", flush=True)
            results[key] = {s: summarize(raw[key][s], 64) for s in systems if raw[key][s]}
            flops = model_flops_per_step(path, 64, args.new_tokens) if os.path.isdir(path) else None
            for r in results[key].values():  # MFU against --peak-tflops (CUDA runs; e.g. 989 for H100 bf16)
                r["model_tflops_per_s"] = flops / r["step_time_s"] / 1e12 if flops else None
                r["mfu"] = r["model_tflops_per_s"] / args.peak_tflops if flops and args.peak_tflops else None
    text = table(results, systems)
    for (m, d), why in failed.items():
        text += "".join(f"\n{m} {d} {s}: {w}" for s, w in why.items())
    print(text)
    import torch
    meta = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                       + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"),
            "threads": args.threads or torch.get_num_threads(), "torch": torch.__version__}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": {f"{m}/{d}": v for (m, d), v in results.items()},
                   "raw": {f"{m}/{d}": v for (m, d), v in raw.items()},
                   "failed": {f"{m}/{d}": v for (m, d), v in failed.items()}}, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(f"{meta}\n\n{text}\n")


if __name__ == "__main__":
    main()
