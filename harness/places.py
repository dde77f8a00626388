"""Where paths lie against each other: the one rule of what a program here writes (train_lean.py's
in harness/paths.py; monitor_memory.py's and scripts/plot_run.py's outputs against their inputs). A
write may not land on (a link to it and a hard link included), inside or around a path the program
reads, nor another it writes, nor inside a run's folder that the run replaces (replaced). It imports
nothing heavy: the tools load it at once."""
import os

WORDS = {"on": "lands on", "inside": "lies inside", "around": "lies around"}
LOCK, SETTINGS = ".lock", "settings.txt"   # a run's OUT_DIR holds both: its lock stays after it
# the folders of a run's OUT_DIR that the run replaces or prunes as a whole, and what it does there
REPLACED = {"model": "replaces with its trained model at its end",
            "checkpoints": "keeps (and prunes) its checkpoints in"}


def replaced(path: str):
    """(the folder, "the run in OUT_DIR <does>") of a run's folder that resolved path lies inside
    and that run replaces or prunes, or None: an ancestor named in REPLACED beside a run's lock,
    settings or log. No program here writes there: the run would delete it."""
    folder = os.path.dirname(path)
    while folder != os.path.dirname(folder):
        name, parent = os.path.basename(folder), os.path.dirname(folder)
        marks = (LOCK, SETTINGS, "metrics.jsonl")
        if name in REPLACED and any(os.path.isfile(os.path.join(parent, m)) for m in marks):
            return folder, f"the run in {parent} {REPLACED[name]}"
        folder = parent
    return None


def place(a: str, b: str):
    """Where resolved path a lies against resolved path b: "on" it (the same file, under another
    name too), "inside" it, "around" it, or None (apart)."""
    if a == b or os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b):
        return "on"
    if a.startswith(b.rstrip(os.sep) + os.sep):
        return "inside"
    if b.startswith(a.rstrip(os.sep) + os.sep):
        return "around"
    return None


def clash(others: list, writes: list):
    """The one line that refuses a tool's outputs, or None. others: (the flag or argument that names
    it, the path, what is done there: "reads" or "writes") of what no output may touch; writes:
    (flag, path) of the outputs, none on another either. A path of None is left out."""
    outs = [(name, path) for name, path in writes if path is not None]
    for i, (name, path) in enumerate(outs):
        run = replaced(os.path.realpath(path))
        if run:
            return f"{name} {path} lies inside {run[0]}, which {run[1]}: pass another {name}"
        for other, other_path, does in (*others, *((n, p, "writes") for n, p in outs[i + 1:])):
            where = other_path is not None and place(os.path.realpath(path),
                                                     os.path.realpath(other_path))
            if where:
                return (f"{name} {path} {WORDS[where]} {other_path}, which {other} {does}: pass "
                        f"another {name}")
    return None


def figure_error(flag: str, path: str):
    """The one line that refuses a figure's path, or None: a format matplotlib writes (from its
    ending), not a folder. The tools that draw (monitor_memory.py, scripts/plot_run.py) share it."""
    from matplotlib.figure import Figure   # only when a figure is asked for
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    if fmt not in Figure().canvas.get_supported_filetypes():
        return (f"{flag} {path}: a figure is written as .png (or .pdf, .svg, ...), not "
                f"{('.' + fmt) if fmt else 'a name without one'}")
    if os.path.isdir(path):
        return f"{flag} {path} is a folder: pass the path of the figure to write"
    return None
