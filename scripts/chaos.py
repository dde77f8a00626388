#!/usr/bin/env python
"""Kill -9 chaos: a checkpointed training run is SIGKILLed again and again and resumed each time, and
must end exactly where the same run ends when nothing interrupts it.

    python scripts/chaos.py                                  # 12 steps, 6 kills, 4 engine kills
    python scripts/chaos.py --steps 40 --kills 20 --engine-kills 15 --work-dir out/chaos

Two runs of train_lean.py on CPU with one thread (float reductions in one order), driven only by its
command line: an uninterrupted reference, and the chaos run. The chaos run saves every step
(--save-interval 1), evaluates every --eval-interval steps, and is SIGKILLed --kills times, each
time at a moment aimed at in turn: mid-step (generation, scoring or update), mid-save (while a
checkpoint is being written) or mid-evaluation. Each kill is classified by what the files show
afterwards. After each kill it is resumed with --resume (started afresh, --overwrite, while no checkpoint is
complete). Meanwhile Stockfish engines that the trainer started are SIGKILLed now and then
(--engine-kills); the trainer must replace them and score exactly as before.

It then compares, and prints: kills survived by moment, engine kills, steps and records compared,
the bytes of the final model.safetensors that differ, and engines left running by a killed trainer.
Every per-step and evaluation record must be equal except timings and memory; the final weights
must be equal byte for byte; every resumed start must say it continued from its checkpoint (a
trainer that silently started over would end equal too). It also counts the tensors training
moved, and the mean reward spread: with none, equal weights would prove nothing.

--task chess (Stockfish at a low depth, so the P: rewards really come from the engine) when
Stockfish is installed, else --task toy (run without its evaluation: no mid-evaluation kills). Without
--model a tiny random GPT-2 is built (scripts/make_tiny_model.py); for chess it is first taught
briefly to answer P: prompts with a pawn move, so that some answers are legal and score by the
engine's ranking: a random model's completions all score 0, its gradients are 0, and its weights
would come out equal however the resume went.

Exit code: 0 all equal and no engine left behind, 1 a difference, a failed run or a left-over
engine, 2 usage error.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from harness import places  # noqa: E402  (light: the rule of what a program here writes)
TRAIN = os.path.join(REPO, "train_lean.py")
# Keys of a record that differ between identical runs.
VOLATILE = ("_time_s", "samples_per_s", "tokens_per_s", "rss_mb", "rss_peak_mb")
POLL_S = 0.005          # how often the run's files are looked at: a tiny model's save takes tens of ms
ENGINE_KILL_GAP_S = (0.2, 1.5)
LEFTOVER_WAIT_S = 10.0  # for a killed trainer's engines to go
MOMENTS = ("mid-step", "mid-save", "mid-eval")


# --- processes ----------------------------------------------------------------------------------

def process_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def children(pid: int, name: str | None = None) -> list[int]:
    """The running child processes of `pid` (whose command name is `name`, if given), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name in (None, comm) and int(rest[1]) == pid and rest[0] != "Z":
            found.append(int(entry))
    return found


def wait_until(predicate, timeout: float, poll: float = 0.05) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def trainer_env() -> dict:
    """One thread, no hub access, and no GRPO_ variable of the caller's shell changing either run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return env


# --- what a run wrote ---------------------------------------------------------------------------

def read_records(path: str) -> list[dict]:
    """The complete lines of a JSONL log (a killed writer may have left half a line)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith(VOLATILE)} for r in records]


def checkpoint_names(out_dir: str) -> list[str]:
    folder = os.path.join(out_dir, "checkpoints")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def latest_step(out_dir: str) -> int:
    """The step of the newest complete checkpoint, 0 when there is none."""
    steps = [int(n[5:]) for n in checkpoint_names(out_dir)
             if n.startswith("step_") and os.path.isfile(os.path.join(out_dir, "checkpoints", n, "trainer_state.pt"))]
    return max(steps, default=0)


def differing_bytes(a: str, b: str) -> int:
    with open(a, "rb") as f:
        x = f.read()
    with open(b, "rb") as f:
        y = f.read()
    return sum(p != q for p, q in zip(x, y)) + abs(len(x) - len(y))


def equal_tensors(a: str, b: str) -> tuple[int, int]:
    """(tensors equal, tensors in all) of two safetensors files."""
    import torch
    from safetensors.torch import load_file
    x, y = load_file(a), load_file(b)
    same = sum(k in y and x[k].shape == y[k].shape and torch.equal(x[k], y[k]) for k in x)
    return same, len(x.keys() | y.keys())


def moved_tensors(model_dir: str, trained: str) -> int:
    """Tensors that training changed: with none, equal final weights would prove nothing."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    end = load_file(trained)
    return sum(k in start and not torch.equal(start[k], v) for k, v in end.items())


# --- the tiny model -----------------------------------------------------------------------------

def teach_pawn_moves(path: str, steps: int, seed: int = 0) -> None:
    """Fine-tune the model in `path` to answer P: prompts with `B: h2h3` (white) or `B: h7h6` (black).

    Legal in many generated positions, so its sampled answers score by the engine's ranking of the
    move (or as a legal move outside it), or as an illegal one: rewards that vary within a group and
    depend on Stockfish. Prompt and answer are encoded apart and left-padded, as the trainer does.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, REPO)
    from tasks.rookworld.format import policy_prompt
    from tasks.rookworld.positions import random_board

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = []
    for _ in range(200):
        board = random_board(rng)
        answer = tok("B: " + ("h2h3" if board.turn else "h7h6")).input_ids + [tok.eos_token_id]
        rows.append((tok(policy_prompt(board.fen(en_passant="fen"))).input_ids, answer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = rng.sample(rows, 16)
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.eos_token_id)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (p, a) in enumerate(batch):
            start = width - len(p) - len(a)
            ids[i, start:] = torch.tensor(p + a)
            mask[i, start:] = 1
            labels[i, width - len(a):] = torch.tensor(a)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)


def build_model(path: str, chess: bool, teach_steps: int) -> str:
    sys.path.insert(0, HERE)
    from make_tiny_model import build_tiny_model
    build_tiny_model(path, seed=0)
    if chess and teach_steps:
        teach_pawn_moves(path, teach_steps)
    return path


# --- the runs -----------------------------------------------------------------------------------

def train_command(args, out_dir: str, resume: bool) -> list[str]:
    cmd = [sys.executable, TRAIN, "--model", args.model, "--task", args.task, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
           "--max-new-tokens", str(args.max_new_tokens), "--learning-rate", str(args.learning_rate),
           "--seed", str(args.seed), "--out-dir", out_dir, "--save-interval", "1", "--log-level", "info"]
    if args.task == "toy":
        cmd += ["--eval-interval", "0"]   # the mid-evaluation kills are chess's
    else:
        cmd += ["--eval-interval", str(args.eval_interval), "--eval-samples", str(args.eval_samples),
                "--eval-full-samples", str(args.eval_samples),   # the first and last evaluations as small
                "--stockfish-depth", str(args.stockfish_depth)]
    return cmd + (["--resume"] if resume else ["--overwrite"])   # a start with no checkpoint yet starts over


def run_to_end(args, out_dir: str, log_path: str, resume: bool) -> int:
    with open(log_path, "wb") as log:
        return subprocess.run(train_command(args, out_dir, resume), stdout=log, stderr=subprocess.STDOUT,
                              env=trainer_env(), timeout=args.life_timeout).returncode


class Life:
    """One start of the chaos run, SIGKILLed at a planned moment."""

    def __init__(self, args, out_dir: str, log_path: str, rng: random.Random, step_times: dict[int, float]):
        self.args, self.out, self.rng, self.step_times = args, out_dir, rng, step_times
        self.metrics = os.path.join(out_dir, "metrics.jsonl")
        self.start = latest_step(out_dir)
        self.log_path = log_path
        self.proc = None
        self.born_ns = time.time_ns()
        self.engine_kills = 0
        self.engines_seen: set[int] = set()

    def plan(self, moment: str, kills_left: int) -> tuple[str, int] | None:
        """A (moment, step) this life can reach, or None when there is none.

        The step lies within the next (steps left / kills left) steps, so that the kills spread over
        the whole run instead of piling up at its end.
        """
        a = self.args
        first, last = self.start + 1, min(a.steps, self.start + max(2, (a.steps - self.start) // kills_left))
        if moment == "mid-step":
            first += 1   # "step t is running" is seen as step t-1's checkpoint; the first step has none
        if moment == "mid-eval":
            options = [t for t in range(first, last + 1) if t % a.eval_interval == 0 or t == a.steps]
        else:
            options = list(range(first, last + 1))
        return (moment, self.rng.choice(options)) if options else None

    def ours(self, path: str) -> bool:
        """Whether this life has written `path` (what an earlier life left there is not its progress)."""
        try:
            return os.stat(path).st_mtime_ns >= self.born_ns
        except FileNotFoundError:
            return False

    def trained(self) -> tuple[list[dict], list[int]]:
        """This life's view of the log and the steps it has logged itself.

        A resumed trainer first cuts the log back to its checkpoint, a fresh one empties it: until
        it has, the records after `start` are an earlier life's.
        """
        if not self.ours(self.metrics):
            return [], []
        records = read_records(self.metrics)
        return records, [r["step"] for r in records if r.get("kind", "train") == "train" and r["step"] > self.start]

    def reached(self, moment: str, step: int) -> bool:
        """Whether the moment to kill has come (or gone: then the kill is now, classified as it falls)."""
        if moment == "mid-save":
            tmp = os.path.join(self.out, "checkpoints", f".tmp-step_{step:06d}")
            return self.ours(tmp) or latest_step(self.out) >= step
        if moment == "mid-step":   # step-1 is saved, so step `step` has begun
            return latest_step(self.out) >= step - 1
        done = self.trained()[1]
        return bool(done) and max(done) >= step

    def kill_an_engine(self) -> None:
        engines = children(self.proc.pid, "stockfish")
        self.engines_seen.update(engines)
        if engines:
            os.kill(self.rng.choice(engines), signal.SIGKILL)
            self.engine_kills += 1

    def run(self, moment: str, step: int, engine_kills: int) -> bool:
        """Start the trainer, wait for the moment while killing up to `engine_kills` engines, then
        SIGKILL the trainer. False when it ended by itself first (finished, or failed)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(train_command(self.args, self.out, resume=self.start > 0), stdout=log,
                                         stderr=subprocess.STDOUT, env=trainer_env())
        deadline = time.monotonic() + self.args.life_timeout
        next_engine_kill = time.monotonic() + self.rng.uniform(*ENGINE_KILL_GAP_S)
        while not self.reached(moment, step):
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                return False
            if engine_kills > self.engine_kills and time.monotonic() > next_engine_kill:
                self.kill_an_engine()
                next_engine_kill = time.monotonic() + self.rng.uniform(*ENGINE_KILL_GAP_S)
            time.sleep(POLL_S)
        if moment == "mid-step":   # somewhere inside step `step`, as long as steps take
            time.sleep(self.rng.uniform(0, self.step_times.get(step, 0.2)))
        self.engines_seen.update(children(self.proc.pid, "stockfish"))
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return True

    def classify(self) -> str:
        """What the SIGKILL interrupted, read from the files it left."""
        records, done = self.trained()
        if not done:
            return "start-up"
        last = max(done)
        if self.ours(os.path.join(self.out, "checkpoints", f".tmp-step_{last:06d}")):
            return "mid-save"
        evaluated = {r["step"] for r in records if r.get("kind") == "eval"}
        due = self.args.task != "toy" and (last % self.args.eval_interval == 0 or last == self.args.steps)
        return "mid-eval" if due and last not in evaluated else "mid-step"

    def resumed(self) -> bool:
        """Whether the trainer said it continued from the checkpoint (else equality proves little)."""
        with open(self.log_path, errors="replace") as f:
            return self.start == 0 or f"after step {self.start}" in f.read()

    def leftover_engines(self) -> list[int]:
        """Engines of the killed trainer still running after a grace period (there should be none)."""
        wait_until(lambda: not any(map(process_alive, self.engines_seen)), LEFTOVER_WAIT_S)
        return sorted(p for p in self.engines_seen if process_alive(p))


def chaos(args, work: str) -> dict:
    rng = random.Random(args.seed)
    ref, cut = os.path.join(work, "reference"), os.path.join(work, "chaos")
    code = run_to_end(args, ref, os.path.join(work, "reference.log"), resume=False)
    if code != 0:
        return {"failed": f"the reference run exited with code {code} (see {work}/reference.log)"}
    step_times = {r["step"]: r["step_time_s"] for r in read_records(os.path.join(ref, "metrics.jsonl"))
                  if "step_time_s" in r}
    moments = [m for m in MOMENTS if args.task != "toy" or m != "mid-eval"]
    rng.shuffle(moments)
    kills, engine_kills, leftover, lives = [], 0, [], 0
    while len(kills) < args.kills and latest_step(cut) < args.steps:
        lives += 1
        life = Life(args, cut, os.path.join(work, f"life_{lives}.log"), rng, step_times)
        left = args.kills - len(kills)
        target = life.plan(moments[len(kills) % len(moments)], left) or life.plan("mid-save", left)
        killed = life.run(*target, engine_kills=args.engine_kills - engine_kills)
        engine_kills += life.engine_kills
        if not killed:   # it ended before the moment: finished (no more kills to make), or failed
            if life.proc.returncode != 0:
                return {"failed": f"chaos life {lives} exited with code {life.proc.returncode} (see {life.log_path})"}
            break
        leftover += life.leftover_engines()
        kills.append({"aimed": target[0], "step": target[1], "hit": life.classify(), "resumed_from": life.start,
                      "resume_seen": life.resumed()})
        print(f"kill {len(kills)}: aimed {target[0]} of step {target[1]}, hit {kills[-1]['hit']} "
              f"(this start resumed from step {life.start})", flush=True)
    if latest_step(cut) < args.steps:
        code = run_to_end(args, cut, os.path.join(work, "final.log"), resume=latest_step(cut) > 0)
        if code != 0:
            return {"failed": f"the final resume exited with code {code} (see {work}/final.log)"}

    a, b = read_records(os.path.join(ref, "metrics.jsonl")), read_records(os.path.join(cut, "metrics.jsonl"))
    first_difference = next((i for i, (x, y) in enumerate(zip(comparable(a), comparable(b))) if x != y),
                            None if len(a) == len(b) else min(len(a), len(b)))
    final = os.path.join("checkpoints", f"step_{args.steps:06d}", "model.safetensors")
    same, tensors = equal_tensors(os.path.join(ref, final), os.path.join(cut, final))
    steps = [r for r in a if r.get("kind", "train") == "train"]
    summary = {
        "task": args.task, "steps": args.steps, "kills": len(kills),
        "kills_by_moment": {m: sum(k["hit"] == m for k in kills) for m in MOMENTS + ("start-up",)},
        "engine_kills": engine_kills, "kill_log": kills,
        "resumes": sum(k["resumed_from"] > 0 for k in kills), "resumes_seen": sum(k["resumed_from"] > 0
                                                                                  and k["resume_seen"] for k in kills),
        "steps_compared": sum(r.get("kind", "train") == "train" for r in b), "records_compared": len(b),
        "first_differing_record": first_difference,
        "weight_bytes_differing": differing_bytes(os.path.join(ref, final), os.path.join(cut, final)),
        "tensors_equal": same, "tensors": tensors, "engines_left_running": leftover,
        "tensors_moved": moved_tensors(args.model, os.path.join(ref, final)),
        # how much the comparison could show: rewards that vary within groups move the weights
        "reward_std_mean": sum(r["reward_std"] for r in steps) / len(steps),
        "legal_share_mean": sum(r.get("reward_policy_legal", 0.0) for r in steps) / len(steps),
    }
    summary["equal"] = first_difference is None and summary["weight_bytes_differing"] == 0 and same == tensors \
        and not leftover and summary["resumes_seen"] == summary["resumes"]
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="chaos.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a tiny one built in the work folder)")
    p.add_argument("--task", choices=("chess", "toy"), help="default: chess when Stockfish is installed, else toy")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kills", type=int, default=6, help="SIGKILLs of the trainer")
    p.add_argument("--engine-kills", type=int, default=4, help="SIGKILLs of Stockfish engines the trainer started")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--eval-interval", type=int, default=3)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--stockfish-depth", type=int, default=2)
    p.add_argument("--teach-steps", type=int, default=100,
                   help="chess, built model: fine-tuning steps that make some answers legal (0: none)")
    p.add_argument("--seed", type=int, default=0, help="the runs' seed and the kills' timing")
    p.add_argument("--life-timeout", type=float, default=600, help="seconds one start of the trainer may take")
    p.add_argument("--work-dir", help="keep everything here (default: a temporary folder, removed after a "
                   "run that ends equal)")
    p.add_argument("--summary", help="write the figures as JSON here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "group_size", "max_new_tokens", "eval_interval", "eval_samples",
                 "stockfish_depth"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.kills < 0 or args.engine_kills < 0:
        p.error("--kills and --engine-kills must be 0 or more")
    if not sys.platform.startswith("linux"):
        p.error("the chaos run reads /proc to find the trainer's engines: Linux only")
    sys.path.insert(0, REPO)
    from tasks.rookworld.engine import find_stockfish
    if args.task is None:
        args.task = "chess" if find_stockfish() else "toy"
    if args.task == "chess" and not find_stockfish():
        p.error("--task chess needs Stockfish (apt-get install stockfish), or use --task toy")

    clash = places.clash([], [("--summary", args.summary)])
    if clash:
        p.error(clash)
    work = args.work_dir or tempfile.mkdtemp(prefix="chaos-")
    if os.path.exists(os.path.join(work, "chaos")) or os.path.exists(os.path.join(work, "reference")):
        p.error(f"--work-dir {work} holds an earlier chaos run: pass an empty folder")
    os.makedirs(work, exist_ok=True)
    summary = {"failed": "interrupted"}
    try:
        if args.model is None:
            args.model = build_model(os.path.join(work, "model"), args.task == "chess", args.teach_steps)
        summary = chaos(args, work)
    finally:
        if args.work_dir is None and summary.get("equal"):
            shutil.rmtree(work, ignore_errors=True)
        else:   # what went wrong is in the runs' logs
            print(f"chaos.py: the runs are in {work}", file=sys.stderr)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=2)
    if "failed" in summary:
        print(f"chaos.py: {summary['failed']}", file=sys.stderr)
        return 1
    moments = ", ".join(f"{n} {m}" for m, n in summary["kills_by_moment"].items() if n)
    first = summary["first_differing_record"]
    print(f"--task {summary['task']}: {summary['kills']} trainer kills survived ({moments}; "
          f"{summary['resumes_seen']} of {summary['resumes']} resumes continued from their checkpoint), "
          f"{summary['engine_kills']} engine kills; {summary['steps_compared']} steps and "
          f"{summary['records_compared']} records compared, "
          f"{'all equal' if first is None else f'first difference at record {first}'}; "
          f"final weights: {summary['weight_bytes_differing']} bytes differ, "
          f"{summary['tensors_equal']}/{summary['tensors']} tensors equal ({summary['tensors_moved']} moved by training); "
          f"engines left running: {len(summary['engines_left_running'])}; "
          f"mean reward std {summary['reward_std_mean']:.3f}"
          + (f", legal P: answers {summary['legal_share_mean']:.0%}" if summary["task"] == "chess" else ""))
    print("EQUAL" if summary["equal"] else "DIFFERENT")
    return 0 if summary["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
