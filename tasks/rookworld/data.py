"""A reader for RookWorld-format text files: one sample per line, P: or A:.

Lines without a prefix are A: samples, as in the published dataset. A line is kept only if its
prompt is usable: a P: line needs a valid position with a legal move and an `M:` field; an A:
line needs seven `+`-separated fields, a valid position and a syntactically valid UCI move. Other
lines are skipped and counted (blank lines are neither).
"""
from dataclasses import dataclass, field

from tasks.rookworld.format import is_uci, parse_board, parse_env_prompt, prompt_fen, split_env_line


@dataclass
class RookWorldData:
    policy: list[str] = field(default_factory=list)   # P: prompts
    env: list[str] = field(default_factory=list)      # A: prompts
    skipped: int = 0                                  # malformed lines

    def summary(self, path: str) -> str:
        return (f"chess data {path}: {len(self.policy)} P: and {len(self.env)} A: samples, "
                f"{self.skipped} malformed lines skipped")


def _policy_prompt(line: str) -> str | None:
    if "M:" not in line:
        return None
    prompt = line[:line.index("M:")]
    board = parse_board(prompt_fen(prompt))
    return prompt if board is not None and any(board.legal_moves) else None


def _env_prompt(line: str) -> str | None:
    split = split_env_line(line)
    if split is None:
        return None
    fields = parse_env_prompt(split[0])
    if fields is None or not is_uci(fields.move) or parse_board(fields.fen) is None:
        return None
    return split[0]


def read_rookworld(path: str) -> RookWorldData:
    data = RookWorldData()
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            if line.startswith("P: "):
                prompt = _policy_prompt(line)
                target = data.policy
            else:
                prompt = _env_prompt(line)
                target = data.env
            if prompt is None:
                data.skipped += 1
            else:
                target.append(prompt)
    return data
