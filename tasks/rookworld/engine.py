"""Stockfish for the P: reward: discovery, a small pool of persistent engines, a per-FEN cache.

Each analysis is fixed-depth multi-PV 5 and starts from a cleared hash (a new "game" per call),
so a position's analysis does not depend on which positions were analysed before it or by which
engine of the pool: rewards are reproducible whatever the batch order.

A run that fails must still exit, and leave nothing behind:
- an engine that dies, or gives no analysis within `timeout` seconds (a hung engine: nothing else
  would ever notice it), is killed, restarted and the position retried; when the retries fail too,
  the position's Future raises, and the trainer gives that completion the task's min_reward;
- the pool's threads, and python-chess's event-loop thread of each engine, are daemon threads, and
  the engines are closed at interpreter exit too: a script that forgets close() still exits;
- on Linux each engine is killed when the process that started it dies, even by SIGKILL (a
  parent-death signal), and sits in its own process group, so a Ctrl-C meant for the trainer (which
  finishes its step before stopping) does not kill the engines that step still needs.
"""
import ctypes
import os
import shutil
import signal
import sys
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from queue import Empty, Queue

import chess
import chess.engine

DEBIAN_PATH = "/usr/games/stockfish"   # apt's stockfish package is installed here, off PATH
MATE_SCORE = 100_000                   # centipawns; a mate in n reads as +-(1000 - n/100) pawns
INSTALL_HINT = ("install Stockfish (apt-get install stockfish, brew install stockfish) or pass "
                "--stockfish-path, or use --task chess-env, which needs no engine")
# Seconds one analysis may take before its engine counts as hung. A normal fixed-depth analysis
# (multi-PV 5, one thread) takes tens of milliseconds at depth 10 and about a second at depth 14,
# a few seconds for the slowest positions on a loaded machine; each 2 plies of depth cost about
# 2.5x. 60 s leaves room for the slowest positions up to about depth 18 on a busy machine, and a
# hung engine costs a minute, not the run.
DEFAULT_TIMEOUT_S = 60.0
STOP_WAIT_S = 5.0                      # for a killed engine's exit to be seen (it is SIGKILLed)


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


class EngineTimeout(TimeoutError):
    """An engine gave no analysis within the pool's timeout; it was killed and replaced."""


class PoolClosed(RuntimeError):
    """The pool was closed before the position's analysis was done."""


PR_SET_PDEATHSIG = 1   # <linux/prctl.h>
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent(parent: int):
    """A preexec_fn arming SIGKILL for the child when the thread that forked it exits.

    Linux sends the parent-death signal when the forking *thread* ends, not the process. python-chess
    forks each engine from that engine's own event-loop thread (asyncio spawns on its loop), and the
    thread lives exactly as long as the engine: it ends when the engine is closed or has died, or
    when the whole process ends, SIGKILL included. Threads that come and go elsewhere (the ones that
    start engines included) do not touch it; tests/tasks/rookworld/test_engine_lifetime.py checks both.
    """
    def preexec():
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:   # the parent died before the signal was armed
            os._exit(1)
    return preexec


def _on_daemon_thread(fn):
    """fn() run on a new daemon thread; its result returned (or its exception raised) here.

    python-chess runs each engine's event loop on a thread it creates with the default daemon flag,
    which a thread inherits from the thread that creates it. Created from the main thread, the loop
    thread would keep the interpreter waiting at exit for as long as the engine is open.
    """
    result = Future()

    def run():
        try:
            result.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result.set_exception(e)

    threading.Thread(target=run, name="stockfish-start", daemon=True).start()
    return result.result()


def _quiet_about_engine_deaths(loop, context) -> None:
    """An event-loop exception handler that leaves out the deaths of engines.

    Killing an engine mid-analysis (a hung one, say) can abandon python-chess's own record of that
    analysis, and asyncio would print its EngineTerminatedError ("Future exception was never retrieved")
    when the record is collected. The pool learns of every death from the analysis it waits on and
    retries or reports it; anything else goes to asyncio's default handler.
    """
    if not isinstance(context.get("exception"), chess.engine.EngineTerminatedError):
        loop.default_exception_handler(context)


def start_engine(path: str) -> chess.engine.SimpleEngine:
    """One Stockfish process: a daemon event-loop thread, its own process group, dies with its parent."""
    options = {"preexec_fn": _die_with_parent(os.getpid())} if _prctl is not None else {}

    def start():
        engine = chess.engine.SimpleEngine.popen_uci(path, setpgrp=True, **options)
        engine.protocol.loop.set_exception_handler(_quiet_about_engine_deaths)
        try:
            # One thread each: the pool, not the engine, is the unit of parallelism, and a single
            # thread keeps a fixed-depth search deterministic.
            engine.configure({"Threads": 1, "Hash": 16})
        except BaseException:
            stop_engine(engine)
            raise
        return engine

    return _on_daemon_thread(start)


def stop_engine(engine: chess.engine.SimpleEngine) -> None:
    """Kill an engine (a hung one too: SIGKILL reaches a stopped process) and wait until it is gone."""
    engine.close()   # closes the transport, which kills the process if it still runs
    try:
        engine.returncode.result(STOP_WAIT_S)
    except Exception:  # noqa: BLE001 - it died some other way, or its loop is gone: nothing to wait for
        pass


class _Engines:
    """The engine processes and one worker thread per engine, fed from a queue of (fen, Future).

    Apart from EnginePool so that neither the workers nor the exit hook refer to the pool: a pool
    dropped without close() is closed when it is garbage collected, else at interpreter exit.
    """

    def __init__(self, path, depth, multipv, retries, timeout, size):
        self.path, self.depth, self.multipv, self.retries, self.timeout = path, depth, multipv, retries, timeout
        self.jobs: Queue = Queue()
        self.lock = threading.Lock()
        self.closed = False
        self.restarts = 0
        self.slots: list[chess.engine.SimpleEngine | None] = []
        self.workers: list[threading.Thread] = []
        try:
            for _ in range(size):
                self.slots.append(self.start_retrying())
        except BaseException:
            self.close()
            raise
        for slot in range(size):
            worker = threading.Thread(target=self.work, args=(slot,), name=f"stockfish-{slot}", daemon=True)
            worker.start()
            self.workers.append(worker)

    def start_retrying(self) -> chess.engine.SimpleEngine:
        """An engine started up front, so that a missing or broken binary fails at once, not in a reward."""
        for attempt in range(self.retries + 1):
            try:
                return start_engine(self.path)
            except Exception:  # noqa: BLE001 - one killed while it started is tried again
                if attempt == self.retries:
                    raise

    def work(self, slot: int) -> None:
        while (job := self.jobs.get()) is not None:
            fen, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.analyse(slot, fen))
            except Exception as e:  # noqa: BLE001 - the Future carries it to whoever scores the position
                future.set_exception(e)

    def analyse(self, slot: int, fen: str) -> Analysis:
        board = chess.Board(fen)
        for attempt in range(self.retries + 1):
            try:
                # A replacement starts here, so that one killed while it starts is just another failure.
                engine = self.slots[slot] or self.install(slot, start_engine(self.path))
                infos = self.search(engine, board)
                break
            except Exception:  # noqa: BLE001 - dead, hung, or killed while starting: all are replaced
                if self.closed:
                    raise PoolClosed("the engine pool was closed") from None
                self.discard(slot)   # even after the last attempt: the next position gets a fresh engine
                if attempt == self.retries:
                    raise
        moves, evals = [], []
        for info in infos:
            if "pv" not in info or not info["pv"]:
                continue
            moves.append(info["pv"][0].uci())
            evals.append(info["score"].pov(board.turn).score(mate_score=MATE_SCORE) / 100)
        return Analysis(tuple(moves), tuple(evals))

    def search(self, engine: chess.engine.SimpleEngine, board: chess.Board):
        """The engine's analysis; an engine still searching after `timeout` seconds is killed.

        python-chess times out only time-limited searches; a fixed-depth one would wait for ever.
        Killing the engine makes the pending analyse() raise, and the caller restarts it.
        """
        expired = threading.Event()

        def expire():
            expired.set()
            engine.close()

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            return engine.analyse(board, chess.engine.Limit(depth=self.depth), multipv=self.multipv, game=object())
        except Exception:
            if expired.is_set():
                raise EngineTimeout(f"Stockfish gave no depth-{self.depth} analysis within {self.timeout:g} s") \
                    from None
            raise
        finally:
            timer.cancel()

    def discard(self, slot: int) -> None:
        """Kill the slot's engine (if it has one); the slot's next analysis starts a new one."""
        with self.lock:
            engine, self.slots[slot] = self.slots[slot], None
        if engine is not None:
            stop_engine(engine)
            with self.lock:
                self.restarts += 1

    def install(self, slot: int, engine: chess.engine.SimpleEngine) -> chess.engine.SimpleEngine:
        with self.lock:
            if not self.closed:
                self.slots[slot] = engine
                return engine
        stop_engine(engine)   # close() ran while it started: it would outlive the pool
        raise PoolClosed("the engine pool was closed")

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            engines = [engine for engine in self.slots if engine is not None]
        while True:   # positions still waiting are moot
            try:
                job = self.jobs.get_nowait()
            except Empty:
                break
            if job is not None:
                job[1].cancel()
        for _ in self.workers:
            self.jobs.put(None)
        for engine in engines:   # an analysis in progress ends now, and its worker sees `closed`
            stop_engine(engine)
        for worker in self.workers:
            if worker is not threading.current_thread():
                worker.join(STOP_WAIT_S)


class EnginePool:
    """`size` Stockfish processes, each behind its own worker thread; `analyse(fen)` returns a cached Future.

    `timeout`: seconds one analysis may take before its engine is killed, restarted and the position
    retried (at most `retries` times; then the Future raises, EngineTimeout for a hung engine).
    """

    def __init__(self, path: str, depth: int = 10, size: int = 1, multipv: int = 5,
                 cache_size: int = 100_000, retries: int = 3, timeout: float = DEFAULT_TIMEOUT_S):
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.path, self.depth, self.multipv, self.retries, self.timeout = path, depth, multipv, retries, timeout
        self._engines = _Engines(path, depth, multipv, retries, timeout, size)
        # Closes the engines when the pool is garbage collected, or at interpreter exit if it is not.
        self._finalizer = weakref.finalize(self, self._engines.close)
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def restarts(self) -> int:
        """Engines replaced so far (dead or hung)."""
        return self._engines.restarts

    def analyse(self, fen: str) -> Future:
        """A Future of the Analysis of a valid position's FEN; submitted once per FEN."""
        with self._lock:
            future = self._cache.get(fen)
            if future is not None:
                self._cache.move_to_end(fen)
                return future
            future = Future()
            if self._engines.closed:
                future.set_exception(PoolClosed("the engine pool was closed"))
                return future
            self._engines.jobs.put((fen, future))
            self._cache[fen] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def forget(self, fen: str) -> None:
        """Drop a cached result (used after a failed analysis so that the next call retries)."""
        with self._lock:
            self._cache.pop(fen, None)

    def engines(self) -> list[chess.engine.SimpleEngine]:
        """The running engines, one per worker but for one being replaced (for tests that kill or stop one)."""
        return [engine for engine in self._engines.slots if engine is not None]

    def pids(self) -> list[int]:
        """The process ids of the current engines."""
        return [engine.transport.get_pid() for engine in self.engines()]

    def close(self) -> None:
        """Kill the engines and stop the workers; positions still waiting get cancelled. Idempotent."""
        self._finalizer()
