"""Checkpoints: the policy and tokenizer as plain transformers folders, plus the trainer state.

    OUT_DIR/checkpoints/step_000120/   model.safetensors, config.json, tokenizer files (from_pretrained works)
                                       trainer_state.pt: optimizer, step, RNG states, the config

A checkpoint is written under a temporary name and renamed into place, so a process killed while
writing leaves at worst a stray temporary folder, never a broken latest checkpoint; the last
`keep` are kept. The prompt stream is a function of (seed, step), so the step is its position.
"""
import os
import random
import re
import shutil

import numpy as np
import torch

from grpo import distributed

SUBDIR = "checkpoints"
STATE = "trainer_state.pt"
_NAME = re.compile(r"step_(\d+)$")


class CheckpointError(ValueError):
    """A resume path that holds no checkpoint (reported as a usage error)."""


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


def step_of(path: str) -> int:
    """The step a checkpoint folder was written after (its name says so)."""
    return int(_NAME.match(os.path.basename(os.path.normpath(path))).group(1))


def latest(path: str):
    """The newest checkpoint at path: a checkpoint itself, a checkpoints folder or an out dir; or None."""
    if os.path.isfile(os.path.join(path, STATE)):
        return path
    found = _checkpoints(path) or _checkpoints(os.path.join(path, SUBDIR))
    return found[-1][1] if found else None


def resolve(resume: str, out_dir: str) -> str:
    """The checkpoint --resume names: 'latest' means the newest in out_dir."""
    where = out_dir if resume == "latest" else resume
    found = latest(where)
    if found is None:
        raise CheckpointError(f"--resume {resume}: no checkpoint in {where} (a checkpoint is a folder with "
                              f"{STATE}): pass a checkpoint path, or run without --resume to start fresh")
    return found


def save(out_dir: str, step: int, policy, tokenizer, state: dict, keep: int) -> str:
    """Write checkpoint `step` atomically, drop all but the newest `keep`; return its path."""
    folder = os.path.join(out_dir, SUBDIR)
    final = os.path.join(folder, f"step_{step:06d}")
    tmp = os.path.join(folder, f".tmp-step_{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
    os.makedirs(tmp)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({**state, "step": step}, os.path.join(tmp, STATE))
    if os.path.exists(final):  # the same step saved again (a resumed run interrupted at once)
        shutil.rmtree(final)
    os.rename(tmp, final)
    for _, old in _checkpoints(folder)[:-keep]:
        shutil.rmtree(old)
    for name in os.listdir(folder):  # temporaries of earlier killed runs
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return final


def save_run(out_dir: str, step: int, policy, tokenizer, optimizer, nonfinite_streak: int, config: dict,
             keep: int):
    """Every rank's RNG states gathered, then rank 0 writes the checkpoint and returns its path (None elsewhere)."""
    rngs = distributed.gather_objects(rng_states())
    path = None
    if distributed.is_main():
        path = save(out_dir, step, policy, tokenizer, {"optimizer": optimizer.state_dict(), "rng": rngs,
                                                        "nonfinite_streak": nonfinite_streak, "config": config}, keep)
    distributed.barrier()
    return path


def save_model(folder: str, policy, tokenizer) -> str:
    """The trained model as a plain Hugging Face folder (from_pretrained loads it), written atomically."""
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def load_state(path: str) -> dict:
    return torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=True)
