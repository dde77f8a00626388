"""Checkpoints: the policy and tokenizer as plain transformers folders, plus the trainer state.

    OUT_DIR/checkpoints/step_000120/   model.safetensors, config.json, tokenizer files (from_pretrained works);
                                       with LoRA adapter_model.safetensors and adapter_config.json instead
                                       of the weights (the base is --model, unchanged)
                                       trainer_state.pt: optimizer, step, RNG states, the settings, the
                                       fingerprint of the model the run started from (--model), --kl-target's
                                       coefficient
                                       manifest.json: every file's size and sha256

A checkpoint is written under a temporary name and renamed into place, so a process killed while
writing leaves at worst a stray temporary folder, never a broken latest checkpoint; the last
`keep` are kept. The prompt stream is a function of (seed, step), so the step is its position.
What the disk did to it later is what the manifest is for: --resume checks it against the files and
continues from the newest intact checkpoint, and moves a damaged one aside (damaged-step_000120).
"""
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil

import numpy as np
import torch

from grpo import distributed
from grpo.model import add_lora, is_lora, load_policy
from harness import log
from harness.guards import StoppedBySignal

SUBDIR = "checkpoints"
ADAPTER = "adapter"  # OUT_DIR/model/adapter: a LoRA run's adapters beside the merged model
STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
MODEL_STEP = "trained_step.json"   # OUT_DIR/model's: the step it was trained to
_NAME = re.compile(r"step_(\d+)$")   # what a run writes
_STEP = re.compile(r"(?:^|-)step_(\d+)(?:\.\d+)?$")   # and what it sets aside: damaged-step_N(.2)


class NonFiniteWeights(RuntimeError):
    """Weights that are not finite, refused by every save: no checkpoint or model holds them."""


def check_finite(policy, what: str) -> None:
    """Raise NonFiniteWeights naming the first trainable weight of policy that is not finite. One
    read of the weights, at a save only: between saves the guard's rule keeps them finite
    (harness/guards.py Guard.step, docs/failures.md)."""
    params = [(n, p.detach()) for n, p in policy.named_parameters() if p.requires_grad]
    with torch.no_grad():   # a sum carries a NaN or inf (the fastest reduction); one sync
        sums = torch.stack([p.sum() for _, p in params]).isfinite().tolist()
    for (name, p), ok in zip(params, sums):
        if not ok and not bool(p.isfinite().all()):   # not a sum that overflowed
            raise NonFiniteWeights(f"{name} holds non-finite values: {what} is not written")


class CheckpointError(ValueError):
    """A resume path that holds no intact checkpoint (reported as a usage error)."""


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the run's initial state; a checkpoint keeps their states)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict:
    """The RNG states of Python, NumPy and torch (and CUDA), in types torch.load(weights_only) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_states(s: dict) -> None:
    random.setstate(s["python"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _checkpoints(folder: str) -> list:
    """(step, path) of the complete checkpoints directly in folder, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        m = _NAME.match(name)
        if m and os.path.isfile(os.path.join(folder, name, STATE)):
            found.append((int(m.group(1)), os.path.join(folder, name)))
    return sorted(found)


def _named_step(path: str):
    """The step a checkpoint's folder name says (step_N, or set aside: damaged-step_N), or None."""
    m = _STEP.search(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def _recorded_step(path: str) -> int:
    state = torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=True, mmap=True)
    return state["step"]


def step_of(path: str) -> int:
    """The step a checkpoint folder was written after: its name says so; a folder named otherwise (a
    copy named best), the step its trainer state records."""
    named = _named_step(path)
    return named if named is not None else _recorded_step(path)


def in_line(path: str, out_dir: str) -> bool:
    """Whether path is one of out_dir's own checkpoints, in its line: step_N in its checkpoints
    folder, not one set aside (abandoned-, damaged-), which goes on only as a new run elsewhere."""
    path, folder = os.path.normpath(path), os.path.realpath(os.path.join(out_dir, SUBDIR))
    named = _NAME.match(os.path.basename(path))
    return named is not None and os.path.realpath(os.path.dirname(path)) == folder


def candidates(path: str) -> list:
    """The checkpoints at path, newest first: a checkpoint itself, or those of a checkpoints folder or out dir."""
    if os.path.isfile(os.path.join(path, STATE)):
        return [path]
    found = _checkpoints(path) or _checkpoints(os.path.join(path, SUBDIR))
    return [p for _, p in reversed(found)]


def _digest(path: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": os.path.getsize(path), "sha256": h.hexdigest()}


def write_manifest(folder: str) -> None:
    """Every file's size and sha256, written last into the (still temporary) checkpoint folder; written again
    (an edited checkpoint's), it leaves out the manifest it replaces."""
    files = {name: _digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder)) if name != MANIFEST}
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(files, f, indent=1)


def damage(path: str):
    """What is wrong with the checkpoint at path, or None when it is intact: its files against its manifest, and
    the step its trainer state records against its folder's name."""
    try:
        if not os.path.exists(os.path.join(path, MANIFEST)):
            return f"{MANIFEST} is missing"
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)
        for check in ("size", "sha256"):   # sizes first: a truncated file is found without reading the others
            for name, expected in files.items():
                file = os.path.join(path, name)
                if not os.path.isfile(file):
                    return f"{name} is missing"
                got = os.path.getsize(file) if check == "size" else _digest(file)["sha256"]
                if got != expected[check]:
                    return f"{name} has {check} {got}, its manifest says {expected[check]}"
        # intact files under another step's name (a copy, a rename): the step is where the prompt
        # stream and the schedule go on from, so a name that says a step must say the one saved
        recorded, named = _recorded_step(path), _named_step(path)
        if named is not None and recorded != named:
            return f"{STATE} records step {recorded}, but the folder's name says step {named}"
    except Exception as e:  # noqa: BLE001 - whatever a damaged file makes a loader raise
        return f"{type(e).__name__}: {str(e).split('. ')[0].splitlines()[0] if str(e) else 'unreadable'}"
    return None


def resolve(resume: str, out_dir: str, set_aside: bool = False) -> str:
    """The intact checkpoint --resume names: 'latest' means the newest in out_dir. A checkpoint named
    itself must be intact; of a folder's, the newest intact one is taken and each damaged one newer than
    it said (with set_aside, one in out_dir's checkpoints is renamed damaged-step_N: never the latest again)."""
    where = out_dir if resume == "latest" else resume
    named, found = os.path.isfile(os.path.join(where, STATE)), candidates(where)
    if not found:
        raise CheckpointError(f"--resume {resume}: no checkpoint in {where} (a checkpoint is a folder with "
                              f"{STATE}): pass a checkpoint path, or run without --resume to start fresh")
    damaged = []
    for path in found:
        problem = damage(path)
        if problem is None:
            for bad, why in damaged:
                log.warn(f"checkpoint {bad} is damaged ({why}): skipped")
            return path
        if named:
            raise CheckpointError(f"--resume {resume}: the checkpoint is damaged ({problem}): pass another one")
        if set_aside and in_line(path, out_dir):
            aside = os.path.join(os.path.dirname(path), "damaged-" + os.path.basename(path))
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            problem += f"; moved aside to {aside}"
        damaged.append((path, problem))
    more = f" (and {len(damaged) - 1} older, as damaged)" if len(damaged) > 1 else ""
    raise CheckpointError(f"--resume {resume}: no intact checkpoint in {where}: the newest, {damaged[0][0]}, is "
                          f"damaged ({damaged[0][1]}){more}: pass a checkpoint from elsewhere, or --overwrite to "
                          f"start over")


def saved_settings(path: str):
    """The settings the checkpoint at path recorded; memory-mapped, not read."""
    return _saved(path, "config")


def saved_start_model(path: str):
    """The fingerprint of the model the checkpoint's run started from, or None where it recorded none."""
    return _saved(path, "start_model")


def _saved(path: str, key: str):
    """One entry of the checkpoint's state (None where it recorded none); memory-mapped, not read."""
    state = torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=True, mmap=True)
    return state.get(key)


def saved_devices(path: str) -> int:
    """How many devices the run that saved the checkpoint trained on (one RNG state each)."""
    return len(_saved(path, "rng"))


def saved_task_code(path: str):
    """The fingerprint of the task's code when the checkpoint was saved, or None (not recorded)."""
    return _saved(path, "task_code")


def fingerprint(model) -> str:
    """A short hash of a model's weights as loaded (fp32, in the order of its state_dict) and of its config less
    where it was read from: what --model held. LoRA adapters are left out: the base they sit on is the start.
    One pass over the weights, no copy."""
    digest = hashlib.sha256()   # hardware-accelerated on most CPUs: faster than blake2b or md5 there
    conf = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest.update(json.dumps(conf, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


class DiskFull(OSError):
    """A save that failed for want of room on its disk, named as such (the writers' own errors
    say "unexpected pos" or "iostream error")."""


@contextlib.contextmanager
def room_for(tmp: str, what: str, need: int):
    """Inside, the write of `what` into tmp (deleted when the write fails); a failure with less
    free than `need` bytes left on the disk (or the system's "no space" or quota error) is
    DiskFull."""
    try:
        yield
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)   # a partial write holds the room the next one needs
        free, cause = shutil.disk_usage(os.path.dirname(tmp)).free, e
        while cause is not None and getattr(cause, "errno", None) not in (errno.ENOSPC,
                                                                          errno.EDQUOT):
            cause = cause.__cause__ or cause.__context__
        if free < need or cause is not None:
            raise DiskFull(f"{what} was not written: the disk of {os.path.dirname(tmp)} is "
                           f"full ({free / 2**20:.1f} MB free; it takes about "
                           f"{need / 2**20:.1f} MB)") from e
        raise


def weight_bytes(policy) -> int:
    return sum(t.numel() * t.element_size() for t in policy.state_dict().values())


def save(out_dir: str, step: int, policy, tokenizer, state: dict, keep: int) -> str:
    """Write checkpoint `step` atomically, drop all but the newest `keep`; return its path."""
    check_finite(policy, f"checkpoint step {step}")
    folder = os.path.join(out_dir, SUBDIR)
    final = os.path.join(folder, f"step_{step:06d}")
    tmp = os.path.join(folder, f".tmp-step_{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
    os.makedirs(tmp)
    with room_for(tmp, f"checkpoint step {step}", 3 * weight_bytes(policy)):   # and AdamW's moments
        if is_lora(policy):  # the adapters and the model's config: --resume loads them onto --model
            policy.save_pretrained(tmp, save_embedding_layers=False)
            policy.get_base_model().config.save_pretrained(tmp)
        else:
            policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({**state, "step": step}, os.path.join(tmp, STATE))
        write_manifest(tmp)
    if os.path.exists(final):  # the same step saved again (a resumed run interrupted at once)
        drop(final)
    os.rename(tmp, final)
    for _, old in _checkpoints(folder)[:-keep]:
        drop(old)
    for name in os.listdir(folder):  # temporaries of earlier killed runs
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return final


class Saver:
    """The run's checkpoints. save() writes one (rank 0) on every rank's behalf; completed(step) follows the training
    done; and as the context around the loop it keeps that training when the run fails after it.

    On an exception (evaluation, logging, the final save, a full disk: anything outside an update), rank 0
    writes a checkpoint of the last completed step, if it is newer than the last one saved, and the
    exception goes on (traceback, exit 1). Rank 0 writes it alone, with no collective: another rank may be
    waiting in one, and its weights and optimizer state are every rank's; every rank's RNG states were
    gathered when the step completed. A failure on another rank reaches rank 0 as one of its collectives
    failing (gloo: "Connection closed by peer"). What it cannot keep: an exception in the middle of an
    update that had stepped the optimizer (the weights are no step's then). A save that fails too is
    said in one line beside the traceback.
    """

    def __init__(self, out_dir: str, policy, tokenizer, optimizer, config: dict, keep: int, step: int,
                 nonfinite_streak: int, reference=None, start_model=None, task_code=None):
        """reference: a reference that moves (--ref-sync-steps), saved with the step; None when it stays the
        starting model, which --resume loads again. start_model: that model's fingerprint, compared on
        --resume; task_code: the task's source file's (harness/task.py code_fingerprint), said when it
        changed."""
        self.out_dir, self.policy, self.tokenizer, self.optimizer = out_dir, policy, tokenizer, optimizer
        self.start_model, self.task_code = start_model, task_code
        self.reference = reference
        self.config, self.keep = config, keep
        self.step = self.saved = step   # a fresh run's step 0 is its --model; a resumed run's is on disk
        self.streak, self.kl_coef = nonfinite_streak, None
        self.updates = self.updates_at_step = 0   # optimizer steps taken, and when the last step completed
        self.rngs = None   # the ranks' RNG states when the last step completed
        optimizer.register_step_post_hook(self._counted)

    def _counted(self, optimizer, args, kwargs) -> None:
        self.updates += 1

    def completed(self, step: int, nonfinite_streak: int, kl_coef: float = None) -> None:
        """Step `step`'s update returned: the weights and optimizer state are those after it; kl_coef: with
        --kl-target, the coefficient the next step trains with. Every rank's RNG states are gathered
        (every rank) for a save after a failure, when the ranks cannot meet."""
        self.step, self.streak, self.updates_at_step, self.kl_coef = step, nonfinite_streak, self.updates, kl_coef
        self.rngs = distributed.gather_objects(rng_states())  # every rank

    def _write(self, rngs: list) -> str:
        state = {"optimizer": self.optimizer.state_dict(), "rng": rngs, "nonfinite_streak": self.streak,
                 "config": self.config, "start_model": self.start_model,
                 "task_code": self.task_code}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        if self.kl_coef is not None:
            state["kl_coef"] = self.kl_coef
        return save(self.out_dir, self.step, self.policy, self.tokenizer, state, self.keep)

    def save(self, rngs: list):
        """Rank 0 writes the checkpoint and returns its path (None elsewhere); rngs: every rank's rng_states(),
        gathered by the caller."""
        path = self._write(rngs) if distributed.is_main() else None
        self.saved = self.step
        return path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        stopped = exc_type is not None and issubclass(exc_type, StoppedBySignal)
        failed = exc_type is not None and (issubclass(exc_type, Exception) or stopped)
        if not failed or not distributed.is_main():
            return False
        if stopped:   # the step under way given up: the last finished one kept
            log.warn(self.stopped(exc.why))
            return False
        if issubclass(exc_type, NonFiniteWeights):
            log.warn(f"the weights are not finite: nothing newer than "
                     f"{f'step {self.saved}' if self.saved else 'the start'} is saved")
        elif self.updates != self.updates_at_step:
            log.warn(f"the run failed in the middle of step {self.step + 1}'s update, which had changed the weights: "
                     f"nothing newer than {f'step {self.saved}' if self.saved else 'the start'} is saved")
        elif self.step > self.saved:
            try:
                log.warn(f"the run failed after step {self.step}: saved it to {self._write(self.rngs)}; "
                         f"fix the cause, then continue with --resume")
            except Exception as e:  # noqa: BLE001 - the traceback that follows is the run's own failure
                log.warn(f"could not save step {self.step} after the failure either ({type(e).__name__}: {e}): "
                         f"the steps after {f'step {self.saved}' if self.saved else 'the start'} are lost")
        return False

    def stopped(self, why: str) -> str:
        """The step under way was given up (why: the signal, or the reward timeout): the last finished
        step saved when the weights are still its; what was kept, said in one line (rank 0)."""
        where = f"step {self.saved}" if self.saved else "the start"
        if self.updates != self.updates_at_step:
            return (f"stopped ({why}) in step {self.step + 1}'s update, which had changed the weights: "
                    f"nothing newer than {where} is saved")
        if self.step > self.saved:
            return (f"stopped ({why}) in step {self.step + 1}: saved step {self.step} to "
                    f"{self._write(self.rngs)}; continue with --resume")
        return (f"stopped ({why}) in step {self.step + 1}: nothing newer than {where} to save"
                + ("; continue with --resume" if self.saved else ""))


def temporary(folder: str) -> str:
    """Where save_model writes the model before it replaces folder."""
    return folder.rstrip("/") + ".tmp"


def save_model(folder: str, policy, tokenizer, step: int) -> str:
    """The trained model as a plain Hugging Face folder (from_pretrained loads it), written atomically, with the
    step it was trained to in MODEL_STEP (a later --resume from an older checkpoint must not replace it unsaid).

    With LoRA (policy: the PeftModel) the folder holds the merged model, the adapters merged into a fresh
    copy of the base model loaded on the CPU (the live policy is left as it is), and the adapters alone in
    folder/adapter (PeftModel.from_pretrained(base, folder/adapter) loads them)."""
    check_finite(policy, f"the model of step {step}")
    tmp = temporary(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    with room_for(tmp, f"the model of step {step}", weight_bytes(policy)):
        if is_lora(policy):
            adapter = os.path.join(tmp, ADAPTER)
            policy.save_pretrained(adapter, save_embedding_layers=False)
            base = policy.peft_config[policy.active_adapter].base_model_name_or_path
            merged = add_lora(load_policy(base, "cpu"), 0, 0, adapter=adapter).merge_and_unload()
            merged.save_pretrained(tmp)
        else:
            policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        written = sorted(_files(tmp)) + [MODEL_STEP]
        with open(os.path.join(tmp, MODEL_STEP), "w", encoding="utf-8") as f:
            json.dump({"step": step, "files": written}, f)
        kept = keep_others(folder, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    if kept:
        log.warn(f"kept what {folder} held besides the trained model: {', '.join(kept)} (the run "
                 f"replaces only the files it wrote there)")
    return folder


def _files(root: str) -> list:
    """Every file under root, relative to it."""
    return [os.path.relpath(os.path.join(d, n), root)
            for d, _, names in os.walk(root) for n in names]


def drop(path: str) -> None:
    """Delete checkpoint `path`, but not what the run did not write there (the files its manifest
    lists are the run's): those are copied to kept-step_N beside it first, and named."""
    own = {MANIFEST, STATE}
    with contextlib.suppress(OSError, ValueError, TypeError):
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            own |= set(json.load(f))
    aside = os.path.join(os.path.dirname(path), "kept-" + os.path.basename(path))
    kept = copy_others(path, own, aside)
    shutil.rmtree(path)
    if kept:
        log.warn(f"checkpoint {path} held files the run did not write ({', '.join(kept)}): "
                 f"kept in {aside} as the checkpoint was deleted")


def keep_others(folder: str, new: str) -> list:
    """The files in the model folder that the trainer did not write (a model card, a figure),
    copied into its new version `new` (copy_others). The trainer's own files are those MODEL_STEP
    lists; a folder without the list (written before it was kept) holds only what save_pretrained
    wrote, and the step file: its files with known endings are the trainer's."""
    if not os.path.isdir(folder):
        return []
    try:
        with open(os.path.join(folder, MODEL_STEP), encoding="utf-8") as f:
            own = set(json.load(f).get("files", ()))
    except (OSError, ValueError, AttributeError):
        own = set()
    return copy_others(folder, own, new)


def copy_others(folder: str, own: set, new: str) -> list:
    """The files under folder that `own` does not name (empty: those without TRAINER_ENDINGS),
    copied into `new`; one whose name is taken there kept as NAME.kept. Returns them as kept."""
    kept = []
    for name in sorted(_files(folder)):
        if name in own or not own and name.endswith(TRAINER_ENDINGS):
            continue
        target = os.path.join(new, name)
        target += ".kept" * os.path.exists(target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(folder, name), target)
        kept.append(os.path.relpath(target, new))
    return kept


# what save_pretrained writes, for a model folder saved before MODEL_STEP listed its files
TRAINER_ENDINGS = (".json", ".safetensors", ".bin", ".txt", ".model", ".jinja")


def model_step(folder: str):
    """The step the trained model in folder was saved after (save_model), or None: no such model, or one this
    trainer did not write."""
    try:
        with open(os.path.join(folder, MODEL_STEP), encoding="utf-8") as f:
            return json.load(f)["step"]
    except FileNotFoundError:
        return None


def load_state(path: str) -> dict:
    return torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=True)
