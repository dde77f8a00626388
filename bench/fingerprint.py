"""A run's fingerprint: what it computed, without what it cost. Two runs that compute the same have the same one.

    python bench/fingerprint.py [--ignore KEY,KEY] OUT_DIR [OUT_DIR ...]

Prints, per run folder, a sha256 of its metrics.jsonl records with the times, rates and memory readings
left out (they differ from run to run on any machine), a sha256 of its trained model's weights
(OUT_DIR/model/*.safetensors), and the number of records. Use it to show that a change of code changed
no number: fingerprint the same command before and after. --ignore leaves those record keys out too: a change
that adds a metric shows with it that every other number is unchanged.
"""
import glob
import hashlib
import json
import os
import sys

# what a record says about the machine's speed and memory, not about the run's arithmetic
COST = ("_time_s", "_mb", "_per_s", "oom_retries", "micro_batch")


def computed(record: dict, ignore=()) -> dict:
    return {k: v for k, v in record.items() if not k.endswith(COST) and k not in COST and k not in ignore}


def fingerprint(out_dir: str, ignore=()) -> tuple:
    metrics, weights = hashlib.sha256(), hashlib.sha256()
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [computed(json.loads(line), ignore) for line in f if line.strip()]
    for record in records:
        metrics.update(json.dumps(record, sort_keys=True).encode())
    for path in sorted(glob.glob(os.path.join(out_dir, "model", "*.safetensors"))):
        with open(path, "rb") as f:
            weights.update(f.read())
    return metrics.hexdigest()[:16], weights.hexdigest()[:16], len(records)


def main(argv=None):
    folders, ignore = sys.argv[1:] if argv is None else list(argv), []
    if folders[:1] == ["--ignore"] and len(folders) > 1:
        ignore, folders = folders[1].split(","), folders[2:]
    if not folders:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for folder in folders:
        if not os.path.isfile(os.path.join(folder, "metrics.jsonl")):
            print(f"fingerprint.py: {folder} holds no metrics.jsonl", file=sys.stderr)
            return 2
        m, w, n = fingerprint(folder, ignore)
        print(f"{folder}: metrics {m} model {w} ({n} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
