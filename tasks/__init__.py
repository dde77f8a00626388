"""The built-in tasks, beside the library: grpo/ never imports them, train_lean.py finds them by name here.

    --task toy            tasks/toy.py: repeat a letter (offline, any tiny model learns it)
    --task add            tasks/add.py: add two digits, some sums held out (offline; make demo)
    --task chess          tasks/rookworld/: RookWorld P: (policy, scored by Stockfish) and A: (environment,
    --task chess-policy   scored by python-chess) prompts mixed, or one kind alone; docs/chess.md
    --task chess-env

Your own task needs no entry here: --task path/to/file.py:Name or --task package.module:Name.
"""
BUILTIN = {
    "toy": "tasks.toy:ToyTask",
    "add": "tasks.add:AddTask",
    "chess": "tasks.rookworld.task:ChessMixTask",
    "chess-policy": "tasks.rookworld.task:ChessPolicyTask",
    "chess-env": "tasks.rookworld.task:ChessEnvTask",
}
DEFAULT = "chess"   # the shipped default model (models/rook-tiny) is a RookWorld chess model


def get_task(name: str, **options):
    """A task object by --task name (built-in, path/to/file.py:Name or module:Name), for scripts and notebooks:
    options are its constructor's keywords (for a built-in chess task: data, stockfish_depth, ...)."""
    from harness import task
    return task.build(task.resolve(name, BUILTIN), options, name)
