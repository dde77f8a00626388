"""One GPU check: everything the GPU issue asks of a card, measured in one command, one table.

    python bench/gpu_check.py --budget 540 --baseline .gpu/base   # one GPU, offline; 9 minutes at most
    python bench/gpu_check.py --only trl,big # some sections again (their keys: --help)
    python bench/gpu_check.py --smoke        # the same sections, tiny, on the CPU (CI runs it)

`sh bench/gpu_kit.sh` makes what a GPU call carries (wheels, Stockfish, the baseline) and
`sh bench/gpu_kit.sh --command` prints the command to run there.

Sections, each a subprocess or a call with its own time limit (one failing is reported, the others
go on), most wanted first: the main job at --baseline (a checkout of c2eee3e, the last commit whose
step took 0.31 s on an H200: `git archive c2eee3e | tar -x -C .gpu/base`) beside this checkout, in bf16, bf16 with
cuDNN's attention off and fp32, and this checkout without its decode graph (where the main job's
time went); the main job (`make train`'s command, a few steps); the whole GRPO step
at the 124M shape (bench/run.py's workload: 64 = 8 x 8 completions of 144 tokens, KL on) with no
speed flags, with --compile on, TRL's GRPOTrainer (when trl imports) and the floor; ours and TRL on
the varied workload (bench/run.py --lengths varied), with the compacted decoder's compilations;
decode tokens/s and ops (CUDA: kernels) per token, eager, graphed and compiled, with the graphs
recorded and replayed (the CUDA runtime's calls, profiled); recompilations after the first step; peak memory;
same seed, same bits; monitor_memory.py's clean (exit 0) and leaking (exit 1) verdicts; an out-of-
memory snapshot provoked and found where the console says (CUDA only); the same step at
Qwen2.5-0.5B's shape (random weights, built here); monitor_memory.py --sweep under a 24 GB budget.
Every command's output, with TORCH_LOGS=cudagraphs,recompiles, is kept in the work folder (one .log
a run). It installs nothing and reads no network.
"""
import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench.common import model_dir, task_flag  # noqa: E402

LEAKY_TASK = '''
import torch
KEPT = []
class Leaky:
    """The toy task's prompts; every reward keeps 256 kB on the run's device (16 MB a step at batch 64)."""
    name, min_reward = "leaky", 0.0
    def prompts(self, n, rng):
        return [f"say {rng.choice('ab')}:" for _ in range(n)]
    def reward(self, prompt, completion):
        KEPT.append(torch.ones(2 ** 16, device="cuda" if torch.cuda.is_available() else "cpu"))
        return float(prompt[4] in completion)
'''


def shape(smoke: bool) -> dict:
    """The workload: the issue's on a GPU; --smoke a tiny one that a 2-core CPU runs in seconds a step."""
    if smoke:
        return dict(model="tiny", big="tiny-llama", batch=16, tokens=16, warmup=1, steps=2, sweep="8,16",
                    budget_gb=None)
    return dict(model="gpt2-124m", big="qwen2.5-0.5b", batch=64, tokens=144, warmup=2, steps=6, sweep="64,96,128",
                budget_gb=24)


def train_command(path, s, out, extra=(), varied: bool = False):
    """train_lean.py on bench/run.py's workload, with no speed flag unless `extra` names one; varied: its
    varied lengths (bench/varied_ours.py), else every completion s["tokens"] long."""
    script = os.path.join(HERE, "varied_ours.py") if varied else os.path.join(REPO, "train_lean.py")
    fixed = [] if varied else ["--min-new-tokens", str(s["tokens"])]
    return [sys.executable, script, "--model", path, "--task", task_flag("chess-a"),
            "--batch-size", str(s["batch"]), "--group-size", "8", "--max-new-tokens", str(s["tokens"]),
            *fixed, "--kl-coef", "0.02", "--seed", "0", "--eval-interval", "0",
            "--steps", str(s["warmup"] + s["steps"]), "--out-dir", out, "--log-level", "warning", *extra]


DEADLINE = [float("inf")]   # --budget: no command runs past it
LOGS = []   # the work folder, where each command's output is kept


def run(cmd, timeout, cwd=REPO, **kw):
    left = DEADLINE[0] - time.monotonic()
    if left < 5:
        raise TimeoutError("the time budget is spent")
    env = {**os.environ, "TORCH_LOGS": os.environ.get("TORCH_LOGS", "cudagraphs,recompiles")}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=min(timeout, left),
                          env=env, **kw)
    if LOGS:
        with open(os.path.join(LOGS[0], f"{len(os.listdir(LOGS[0])):03d}.log"), "w") as f:
            f.write(f"$ (cd {cwd}; {' '.join(cmd)})\n{proc.stdout}{proc.stderr}")
    return proc.returncode, proc.stdout + proc.stderr


def phases(recs) -> dict:
    """Median seconds of the step and its phases over the measured records."""
    keys = {"step s": "step_time_s", "generation s": "gen_time_s", "reference s": "ref_time_s",
            "training s": "train_time_s"}
    return {k: statistics.median(r[f] for r in recs) for k, f in keys.items() if all(f in r for r in recs)}


def graph_skips(recs) -> dict:
    """The times torch ran the compiled decode step without CUDA graphs (recorded on CUDA only)."""
    if not any("decode_graph_skips" in r for r in recs):
        return {}
    return {"CUDA graph skips": sum(r.get("decode_graph_skips", 0) for r in recs)}


def graph_counts(recs) -> dict:
    """The decode graphs the run recorded and replayed (--decode-graph), all steps and after step 1."""
    if not any("decode_graphs" in r for r in recs):
        return {}
    return {"decode graphs": sum(r["decode_graphs"] for r in recs),
            "graphs after step 1": sum(r["decode_graphs"] for r in recs[1:]),
            "replays": sum(r["decode_replays"] for r in recs)}


def records(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "samples_per_s" in r]


# the regression's arms: flags, and whether cuDNN's attention is switched off before the run
ARMS = {"bf16": (["--dtype", "bf16"], False), "bf16 cudnn-sdp off": (["--dtype", "bf16"], True),
        "fp32": (["--dtype", "fp32"], False)}


def main_job(tree, s, out, flags=(), cudnn_off=False):
    """`make train`'s command in checkout `tree` (a few steps, no evaluation): the median step and
    phases over the steps after the first."""
    steps = 2 if s["model"] == "tiny" else 8
    args = ["train_lean.py", "--steps", str(steps), "--eval-interval", "0", "--out-dir", out,
            "--log-level", "warning", *(["--batch-size", "16"] if s["model"] == "tiny" else []), *flags]
    cmd = [sys.executable, *args]
    if cudnn_off:   # the same command, cuDNN's attention kernels switched off in its process
        cmd = [sys.executable, "-c", "import runpy, sys, torch; torch.backends.cuda.enable_cudnn_sdp(False); "
               f"sys.path.insert(0, '.'); sys.argv = {args!r}; runpy.run_path(sys.argv[0], run_name='__main__')"]
    code, text = run(cmd, 300, cwd=tree)
    if code:
        raise RuntimeError(f"exit {code}: {text.strip().splitlines()[-1] if text.strip() else ''}")
    recs = records(out)
    return recs, phases(recs[1:] or recs)


def regression_section(s, work, baseline):
    """Where the main job's time went since c2eee3e: its step and phases there (--baseline) and
    here, in each of ARMS, and here without the decode graph."""
    if baseline is None:
        return {"skipped": "no --baseline checkout (git archive c2eee3e | tar -x -C .gpu/base)"}
    out, arms = {}, ARMS if s["model"] != "tiny" else ["bf16 cudnn-sdp off"]   # --smoke: each path once
    runs = [(baseline, "base", arm) for arm in arms] + [(REPO, "here", arm) for arm in arms]
    for tree, tag, arm in runs + [(REPO, "here", "bf16 graph off")]:
        flags, cudnn_off = ARMS.get(arm, (["--dtype", "bf16", "--decode-graph", "off"], False))
        _, times = main_job(tree, s, os.path.join(work, f"main-{tag}-{arm.replace(' ', '-')}"), flags,
                            cudnn_off)
        out[f"{tag} {arm}"] = " / ".join(f"{times.get(k, float('nan')):.3f}" for k in
                                         ("step s", "generation s", "reference s", "training s"))
    return {"step / generation / reference / training s": out}


def main_job_section(s, work):
    """`make train`'s command (the default model, task and settings), a few steps, no evaluation."""
    recs, times = main_job(REPO, s, os.path.join(work, "main-job"))
    measured = recs[1:] or recs
    return {"samples/s": statistics.median(r["samples_per_s"] for r in measured), **times,
            **graph_counts(recs),
            "peak MB": max(r.get("cuda_peak_mb", r["rss_peak_mb"]) for r in recs),
            "compilations": sum(r.get("decode_compiles", 0) for r in recs), **graph_skips(recs),
            "reward first/last": f"{recs[0]['reward_mean']:.3f}/{recs[-1]['reward_mean']:.3f}"}


def step_section(path, s, work, name, extra=(), timeout=300, varied=False):
    """The whole step: median samples/s over the measured steps, their max/min, peak memory, the decode
    step's compilations (varied: one per live-row bucket and prompt width) and those after step 1."""
    out = os.path.join(work, name)
    code, text = run(train_command(path, s, out, extra, varied), timeout)
    if code:
        raise RuntimeError(f"exit {code}: {text.strip().splitlines()[-1] if text.strip() else ''}")
    recs = records(out)
    measured = [r["samples_per_s"] for r in recs[s["warmup"]:]]
    peak = max(r.get("cuda_peak_mb", r["rss_peak_mb"]) for r in recs)
    later = sum(r.get("decode_compiles", 0) for r in recs[1:])
    return {"samples/s": statistics.median(measured), "max/min": max(measured) / min(measured),
            **phases(recs[s["warmup"]:]), "peak MB": peak, **graph_skips(recs), **graph_counts(recs),
            "compilations": sum(r.get("decode_compiles", 0) for r in recs), "recompiles after step 1": later,
            "out": out}


def peer_section(system, path, s, work, dtype, timeout=300, lengths="fixed"):
    """TRL's GRPOTrainer or the floor on the same workload (bench/trl_run.py, bench/floor_run.py)."""
    out = os.path.join(work, f"{system}-{lengths}.jsonl")
    script = {"trl": "trl_run.py", "floor": "floor_run.py"}[system]
    code, text = run([sys.executable, os.path.join(HERE, script), "--model", path, "--dtype", dtype, "--steps",
                      str(s["warmup"] + s["steps"]), "--task", "chess-a", "--new-tokens", str(s["tokens"]),
                      "--lengths", lengths, "--out", out], timeout)
    if code:
        raise RuntimeError(f"exit {code}: {text.strip().splitlines()[-1] if text.strip() else ''}")
    with open(out) as f:
        recs = [r for r in map(json.loads, f) if "samples_per_s" in r][s["warmup"]:]
    return {"samples/s": statistics.median(r["samples_per_s"] for r in recs),
            "peak MB": max(r.get("cuda_peak_mb") or r.get("rss_peak_mb") or 0 for r in recs)}


def decode_section(path, s, device):
    """generate()'s tokens/s on the step's batch (eager, graphed: the default on a GPU, compiled), ops
    / CUDA kernels per token, and the graphs the CUDA runtime recorded and launched in a call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from bench.decode_ops import graph_calls, per_token
    from grpo.decoders import compile_counts, generate
    from grpo.model import load_policy, model_autocast
    model = load_policy(path, device)
    out = {}
    graphed = "capture" if device == "cuda" else "check"   # the CPU: the graph's stand-in
    for tag, compile, graph in (("eager", False, None), ("graphed", False, graphed),
                                ("compiled", True, None)):
        # the stand-in runs the eager step's ops, slowly: on a CPU they are counted once
        ops, kernels = (per_token(model, torch.device(device), compile=compile, graph=graph)
                        if graph != "check" else (out["eager ops/token"], 0))
        torch.manual_seed(0)
        ids = torch.randint(3, 300, (s["batch"] // 8, 20), device=device).repeat_interleave(8, 0)
        kw = dict(end_ids=0, max_new_tokens=s["tokens"], min_new_tokens=s["tokens"], compile=compile,
                  graph=graph,
                  autocast=model_autocast(torch.device(device), "bf16" if device == "cuda" else "fp32"))
        generate(model, ids, torch.ones_like(ids), **kw)   # compiled: the compilation; graphed: capture
        start = time.perf_counter()
        generate(model, ids, torch.ones_like(ids), **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if compile and device == "cuda":   # the reason, where one was met: TORCH_LOGS=cudagraphs
            out["CUDA graph skips"] = compile_counts()["decode_graph_skips"]
        if device == "cuda" and tag != "eager":   # one more call, profiled: graphs made and launched
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                generate(model, ids, torch.ones_like(ids), **kw)
                torch.cuda.synchronize()
            out[f"{tag} graph calls"] = graph_calls(prof)
        out[f"{tag} tokens/s"] = ids.shape[0] * s["tokens"] / seconds
        out[f"{tag} {'kernels' if kernels else 'ops'}/token"] = kernels or ops
    return out


def bits_section(path, s, work):
    """Same seed, same bits: a second run of the default step fingerprints as the first did."""
    from bench.fingerprint import fingerprint
    first = os.path.join(work, "default")
    again = os.path.join(work, "again")
    code, text = run(train_command(path, s, again), 300)
    if code:
        raise RuntimeError(f"exit {code}")
    a, b = fingerprint(first)[:2], fingerprint(again)[:2]
    return {"same bits": a == b, "fingerprint": " ".join(a)}


def monitor_section(s, work):
    """monitor_memory.py on a clean toy run (exit 0) and on one whose task keeps memory every reward (exit 1)."""
    task = os.path.join(work, "leaky.py")
    with open(task, "w") as f:
        f.write(LEAKY_TASK)
    tiny = model_dir("tiny", os.path.join(REPO, "out", "bench-models"))
    base = [sys.executable, os.path.join(REPO, "monitor_memory.py"), "--steps", "16", "--batch-size", "16",
            "--warmup", "4", "--work-dir", os.path.join(work, "monitor"), "--", "--model", tiny,
            "--max-new-tokens", "8", "--eval-interval", "0"]
    clean, _ = run(base + ["--task", "toy"], 300)
    leaking, text = run(base + ["--task", f"{task}:Leaky"], 300)
    return {"clean exit": clean, "leaking exit": leaking, "verdicts right": clean == 0 and leaking == 1}


def oom_section(path, s, work):
    """An out-of-memory provoked (the card capped at 2% of its memory): the console names a snapshot file,
    and it is there."""
    out = os.path.join(work, "oom")
    code = ("import runpy, sys, torch; torch.cuda.set_per_process_memory_fraction(0.02); "
            f"sys.argv = {train_command(path, s, out)[1:]!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    exit_code, text = run([sys.executable, "-c", code], 300)
    named = [w.strip(".,:;()'\"") for w in text.split() if w.strip(".,:;()'\"").endswith(".pickle")]
    found = [p for p in named if os.path.isfile(p if os.path.isabs(p) else os.path.join(REPO, p))]
    lines = text.strip().splitlines()
    return {"exit": exit_code, "snapshot named": named[:1] or "-", "snapshot found": bool(found),
            "in the folder": sorted(os.listdir(os.path.join(out, "memory")))
            if os.path.isdir(os.path.join(out, "memory")) else "-", "last line": lines[-1][:160] if lines else ""}


def sweep_section(path, s, work):
    """monitor_memory.py --sweep: the largest batch that fits the budget (a 24 GB card on a GPU)."""
    cmd = [sys.executable, os.path.join(REPO, "monitor_memory.py"), "--sweep", s["sweep"], "--steps", "2",
           "--work-dir", os.path.join(work, "sweep"), "--summary", os.path.join(work, "sweep.json")]
    cmd += ["--budget-gb", str(s["budget_gb"])] if s["budget_gb"] else []
    code, text = run(cmd + ["--", "--model", path, "--task", task_flag("chess-a"), "--max-new-tokens",
                            str(s["tokens"]), "--min-new-tokens", str(s["tokens"]), "--eval-interval", "0"], 480)
    lines = [line for line in text.splitlines() if "fit" in line.lower()]
    return {"exit": code, "says": lines[-1].strip() if lines else text.strip().splitlines()[-1]}


def sections(s, path, big, work, device, dtype, baseline) -> list:
    """(key, name, call), most wanted first: --budget skips from the end."""
    trl = importlib.util.find_spec("trl") is not None
    no_trl = {"skipped": "trl does not import"}
    return [
        ("regression", "the main job since c2eee3e", lambda: regression_section(s, work, baseline)),
        ("main", "the main job (make train's, a few steps)", lambda: main_job_section(s, work)),
        ("default", "ours, defaults", lambda: step_section(path, s, work, "default")),
        ("varied", "ours, varied lengths", lambda: step_section(path, s, work, "varied", varied=True)),
        ("trl", "TRL GRPOTrainer", lambda: peer_section("trl", path, s, work, dtype) if trl else no_trl),
        ("trl-varied", "TRL, varied lengths",
         lambda: peer_section("trl", path, s, work, dtype, lengths="varied") if trl else no_trl),
        ("compiled", "ours, --compile on", lambda: step_section(path, s, work, "compiled", ["--compile", "on"])),
        ("bits", "same seed, same bits", lambda: bits_section(path, s, work)),
        ("decode", "decode", lambda: decode_section(path, s, device)),
        ("monitor", "memory monitor", lambda: monitor_section(s, work)),
        ("oom", "out-of-memory snapshot",
         lambda: oom_section(path, s, work) if device == "cuda" else {"skipped": "CUDA only"}),
        ("floor", "floor", lambda: peer_section("floor", path, s, work, dtype)),
        ("big", f"ours, {s['big']}", lambda: step_section(big, s, work, "big")),
        ("sweep", "batch sweep", lambda: sweep_section(path, s, work))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI): the sections, not the numbers")
    ap.add_argument("--out", default=os.path.join(REPO, "out", "gpu_check"))
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="seconds for the whole check: a section that would start or run past it is skipped "
                         "or stopped, and said (a lent GPU's lease is short)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="a checkout of c2eee3e for the regression section (default: .gpu/base when "
                         "there; --smoke: this checkout)")
    ap.add_argument("--only", default=None, metavar="KEYS",
                    help="comma-separated section keys: regression, main, default, varied, trl, trl-varied, compiled, bits, "
                         "decode, monitor, oom, floor, big, sweep (bits needs default's run)")
    args = ap.parse_args(argv)
    import torch
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if not args.smoke and device != "cuda":
        print("gpu_check.py: no CUDA device here; --smoke runs the sections on the CPU", file=sys.stderr)
        return 2
    if args.budget is not None:
        DEADLINE[0] = time.monotonic() + args.budget
    s = shape(args.smoke)
    root = os.path.join(REPO, "out", "bench-models")
    path, big = model_dir(s["model"], root), model_dir(s["big"], root)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-check-", dir=args.out)
    LOGS.append(os.path.join(work, "logs"))
    os.makedirs(LOGS[0])
    dtype = "bf16" if device == "cuda" else "fp32"
    kit = os.path.join(REPO, ".gpu", "base")
    baseline = args.baseline or (REPO if args.smoke else kit if os.path.isdir(kit) else None)
    table = sections(s, path, big, work, device, dtype, baseline)
    only = args.only.split(",") if args.only else [key for key, _, _ in table]
    unknown = sorted(set(only) - {key for key, _, _ in table})
    if unknown:
        print(f"gpu_check.py: --only: no section {', '.join(unknown)}", file=sys.stderr)
        return 2
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "smoke": args.smoke,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": s["model"]}
    results, failed = {}, []
    for key, name, section in table:
        if key not in only:
            continue
        start = time.perf_counter()
        try:
            if DEADLINE[0] - time.monotonic() < 30:
                raise TimeoutError("the time budget is spent")
            results[name] = section()
        except TimeoutError:   # the budget's: said, not a failure of the code
            results[name] = {"skipped": "the time budget is spent"}
        except Exception as e:   # one section's failure is a row of the table; the others still run
            results[name] = {"FAILED": f"{type(e).__name__}: {e}"[:200]}
            failed.append(name)
        results[name]["s"] = round(time.perf_counter() - start, 1)
        print(f"[{name}] {results[name]}", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:   # kept if the lease ends first
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    for mine, peer in (("ours, defaults", "TRL GRPOTrainer"), ("ours, varied lengths", "TRL, varied lengths")):
        ours, trl = results.get(mine, {}).get("samples/s"), results.get(peer, {}).get("samples/s")
        if ours and trl:
            results[mine]["vs TRL"] = ours / trl
    print(f"\n{meta}\n\n| section | results |\n|---|---|")
    for name, r in results.items():
        text = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k != "out")
        print(f"| {name} | {text} |")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
