"""Stockfish for the P: reward: discovery, a small pool of persistent engines, a per-FEN cache.

Each analysis is fixed-depth multi-PV 5 and starts from a cleared hash (a new "game" per call),
so a position's analysis does not depend on which positions were analysed before it or by which
engine of the pool: rewards are reproducible whatever the batch order. An engine that dies is
restarted and the position retried.
"""
import os
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import Queue

import chess
import chess.engine

DEBIAN_PATH = "/usr/games/stockfish"   # apt's stockfish package is installed here, off PATH
MATE_SCORE = 100_000                   # centipawns; a mate in n reads as +-(1000 - n/100) pawns
INSTALL_HINT = ("install Stockfish (apt-get install stockfish, brew install stockfish) or pass "
                "--stockfish-path, or use --task chess-env, which needs no engine")


def find_stockfish(path: str | None = None) -> str | None:
    """An executable Stockfish: the given path, else `stockfish` on PATH, else Debian's; or None."""
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    found = shutil.which("stockfish")
    if found:
        return found
    return DEBIAN_PATH if os.access(DEBIAN_PATH, os.X_OK) else None


@dataclass(frozen=True)
class Analysis:
    """The engine's top moves in rank order with their evaluations (pawns, side to move's view)."""
    moves: tuple[str, ...]
    evals: tuple[float, ...]


class EnginePool:
    """`size` Stockfish processes behind a thread pool; `analyse(fen)` returns a cached Future."""

    def __init__(self, path: str, depth: int = 10, size: int = 1, multipv: int = 5,
                 cache_size: int = 100_000, retries: int = 3):
        self.path, self.depth, self.multipv, self.retries = path, depth, multipv, retries
        self._idle: Queue = Queue()
        for _ in range(size):
            self._idle.put(self._start())
        self._workers = ThreadPoolExecutor(max_workers=size, thread_name_prefix="stockfish")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.restarts = 0

    def _start(self) -> chess.engine.SimpleEngine:
        engine = chess.engine.SimpleEngine.popen_uci(self.path)
        # One thread each: the pool, not the engine, is the unit of parallelism, and a single
        # thread keeps a fixed-depth search deterministic.
        engine.configure({"Threads": 1, "Hash": 16})
        return engine

    def analyse(self, fen: str) -> Future:
        """A Future of the Analysis of a valid position's FEN; submitted once per FEN."""
        with self._lock:
            future = self._cache.get(fen)
            if future is not None:
                self._cache.move_to_end(fen)
                return future
            future = self._workers.submit(self._analyse_now, fen)
            self._cache[fen] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _analyse_now(self, fen: str) -> Analysis:
        board = chess.Board(fen)
        engine = self._idle.get()
        try:
            for attempt in range(self.retries + 1):
                try:
                    infos = engine.analyse(board, chess.engine.Limit(depth=self.depth),
                                           multipv=self.multipv, game=object())
                    break
                except Exception:  # noqa: BLE001 - a killed engine surfaces as CancelledError too
                    if attempt == self.retries:
                        raise
                    engine = self._restart(engine)
            moves, evals = [], []
            for info in infos:
                if "pv" not in info or not info["pv"]:
                    continue
                moves.append(info["pv"][0].uci())
                evals.append(info["score"].pov(board.turn).score(mate_score=MATE_SCORE) / 100)
            return Analysis(tuple(moves), tuple(evals))
        finally:
            self._idle.put(engine)

    def _restart(self, engine: chess.engine.SimpleEngine) -> chess.engine.SimpleEngine:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - it is dead already; only the new one matters
            pass
        with self._lock:
            self.restarts += 1
        return self._start()

    def forget(self, fen: str) -> None:
        """Drop a cached result (used after a failed analysis so that the next call retries)."""
        with self._lock:
            self._cache.pop(fen, None)

    def engines(self) -> list[chess.engine.SimpleEngine]:
        """The idle engines (for tests that need to kill one)."""
        return list(self._idle.queue)

    def close(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=True)   # pending prefetches are moot
        while not self._idle.empty():
            try:
                self._idle.get().quit()
            except Exception:  # noqa: BLE001 - closing a dead engine
                pass
