"""The engine pool's lifetime with real Stockfish processes: a forgotten close() still exits, a hung
engine is replaced, a dead parent (SIGKILL included) leaves no engine behind, a Ctrl-C at the
terminal does not reach the engines."""
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading

import chess.engine
import pytest

from harness.task import score
from tasks.rookworld.engine import EnginePool, _quiet_about_engine_deaths, find_stockfish
from tasks.rookworld.format import policy_prompt

from helpers import env, line_starting, process_alive, wait_until

STOCKFISH = find_stockfish()
pytestmark = [pytest.mark.slow,   # real engines hung, killed and replaced
              pytest.mark.skipif(STOCKFISH is None, reason="no Stockfish on PATH or at /usr/games/stockfish")]
DEPTH = 8
ITALIAN = "r1bqkbnr/pppp1ppp/2n5/4p3/2B1P3/5N2/PPPP1PPP/RNBQK2R b KQkq - 3 3"
SICILIAN = "rnbqkbnr/pp1ppppp/8/2p5/4P3/8/PPPP1PPP/RNBQKBNR w KQkq - 0 2"
EXIT_DEADLINE_S = 10


def python(code, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_a_script_that_never_closes_the_task_exits():
    proc = python(f"""
        from tasks.rookworld.task import ChessPolicyTask
        from tasks.rookworld.format import policy_prompt
        task = ChessPolicyTask(stockfish_path={STOCKFISH!r}, stockfish_depth={DEPTH})
        print("pids", *task.engines().pids(), flush=True)
        print("reward", task.reward(policy_prompt({ITALIAN!r}), "B: f8c5"), flush=True)
        # no task.close(): python-chess's non-daemon threads used to keep the interpreter waiting for ever
    """)
    pids = line_starting(proc, "pids", timeout=300).split()[1:]
    reward = float(line_starting(proc, "reward", timeout=300).split()[1])
    try:   # the deadline runs from the script's last line, not from a start-up that load can slow
        out, err = proc.communicate(timeout=EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script did not exit within {EXIT_DEADLINE_S} s:\n{out}{err[-2000:]}")
    assert proc.returncode == 0, err
    assert reward > 0.1   # a legal move was scored, so the engine really analysed
    assert pids and not any(process_alive(int(pid)) for pid in pids)   # closed at exit, not orphaned


@pytest.fixture
def pool():
    p = EnginePool(STOCKFISH, depth=DEPTH, size=1, timeout=3)
    yield p
    p.close()


def test_a_hung_engine_is_killed_replaced_and_the_position_retried(pool):
    (hung,) = pool.pids()
    os.kill(hung, signal.SIGSTOP)   # alive, silent for ever: only a timeout can tell
    analysis = pool.analyse(ITALIAN).result(timeout=60)
    assert len(analysis.moves) == 5
    assert pool.restarts == 1 and pool.pids() != [hung]
    assert not process_alive(hung)


def test_a_replaced_engine_leaves_nothing_on_stderr():
    # killing a hung engine abandons python-chess's record of its analysis; asyncio used to print that
    # record's EngineTerminatedError ("Future exception was never retrieved") when it was collected
    proc = python(f"""
        import gc, os, signal
        from tasks.rookworld.engine import EnginePool
        pool = EnginePool({STOCKFISH!r}, depth={DEPTH}, size=1, timeout=3)
        os.kill(pool.pids()[0], signal.SIGSTOP)
        print("moves", len(pool.analyse({ITALIAN!r}).result(timeout=60).moves), pool.restarts, flush=True)
        pool.close()
        gc.collect()
    """)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.split() == ["moves", "5", "1"]   # the hung engine was replaced and the position analysed
    assert err == ""


def test_only_engine_deaths_are_left_out_of_the_event_loops_errors(caplog):
    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(_quiet_about_engine_deaths)
        with caplog.at_level("ERROR", logger="asyncio"):
            loop.call_exception_handler({"message": "died", "exception": chess.engine.EngineTerminatedError("x")})
            assert caplog.records == []
            loop.call_exception_handler({"message": "something else", "exception": ValueError("y")})
        assert [r.getMessage() for r in caplog.records] == ["something else"]
    finally:
        loop.close()


def test_when_the_retries_fail_too_the_completion_gets_min_reward_and_scoring_goes_on():
    from tasks.rookworld.task import ChessPolicyTask
    task = ChessPolicyTask(stockfish_path=STOCKFISH, stockfish_depth=DEPTH)
    try:
        # a pool that gives up at once, in place of the one the task would start on first use
        task.pool = EnginePool(STOCKFISH, depth=DEPTH, size=1, timeout=2, retries=0)
        (hung,) = task.pool.pids()
        os.kill(hung, signal.SIGSTOP)
        prompts = [policy_prompt(ITALIAN), policy_prompt(SICILIAN)]
        rewards, _, errors = score(task, prompts, ["B: f8c5", "B: g1f3"])
        assert errors == {"EngineTimeout": 1}
        assert rewards[0] == task.min_reward and rewards[1] > 0.1   # the next position had a fresh engine
        assert not process_alive(hung) and task.pool.restarts == 1
        # the failure is not cached: the position is analysed again when asked again
        assert task.reward(prompts[0], "B: f8c5") > 0.1
    finally:
        task.close()


def test_close_kills_every_engine_a_hung_one_too(pool):
    pids = pool.pids()
    os.kill(pids[0], signal.SIGSTOP)
    pending = pool.analyse(SICILIAN)
    pool.close()
    assert not any(process_alive(pid) for pid in pids)
    assert pending.cancelled() or pending.exception(timeout=10) is not None
    with pytest.raises(Exception, match="closed"):
        pool.analyse(ITALIAN).result(timeout=10)


def test_the_engine_outlives_the_thread_that_started_it():
    # The parent-death signal fires when the *thread* that forked the engine ends: the threads that
    # start engines end at once, and the engine must not go with them.
    pools = []
    starter = threading.Thread(target=lambda: pools.append(EnginePool(STOCKFISH, depth=DEPTH, size=2)))
    starter.start()
    starter.join()
    (pool,) = pools
    try:
        assert not [t for t in threading.enumerate() if t.name == "stockfish-start"]
        assert all(process_alive(pid) for pid in pool.pids())
        assert len(pool.analyse(ITALIAN).result(timeout=60).moves) == 5
        assert len(pool.analyse(SICILIAN).result(timeout=60).moves) == 5
        assert pool.restarts == 0
    finally:
        pool.close()


@pytest.fixture
def silent_engine(tmp_path):
    """An executable that runs silent_engine.py (exec: the engine's pid is the script's)."""
    path = tmp_path / "silent-engine"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(os.path.dirname(__file__), 'silent_engine.py')}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("engine", ["stockfish", "silent"])
def test_no_engine_survives_a_sigkilled_parent(engine, request):
    # Stockfish: one stopped, one searching; a stopped engine never reads the end of its input. The
    # silent engine ignores both its input and SIGHUP: only the parent-death signal ends it.
    path = STOCKFISH if engine == "stockfish" else request.getfixturevalue("silent_engine")
    proc = python(f"""
        import os, signal, time
        from tasks.rookworld.engine import EnginePool
        pool = EnginePool({path!r}, depth=30, size=2)
        pids = pool.pids()
        if {engine == "stockfish"}:
            os.kill(pids[0], signal.SIGSTOP)
        pool.analyse({ITALIAN!r}); pool.analyse({SICILIAN!r})   # depth 30: searching for minutes
        print(*pids, flush=True)
        time.sleep(600)
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(map(process_alive, pids)), proc.stderr.read()
    proc.kill()
    proc.wait()
    assert wait_until(lambda: not any(map(process_alive, pids)), EXIT_DEADLINE_S), \
        f"engines {[p for p in pids if process_alive(p)]} outlived their SIGKILLed parent"


def test_a_ctrl_c_at_the_terminal_does_not_reach_the_engines():
    # The trainer finishes its step on Ctrl-C; the engines that step needs must still be there.
    proc = python(f"""
        import signal, sys
        from tasks.rookworld.engine import EnginePool
        signal.signal(signal.SIGINT, lambda *a: print("interrupted", flush=True))
        pool = EnginePool({STOCKFISH!r}, depth={DEPTH}, size=1)
        print(*pool.pids(), flush=True)
        sys.stdin.readline()
        print(len(pool.analyse({ITALIAN!r}).result().moves), pool.restarts, flush=True)
        pool.close()
    """, stdin=subprocess.PIPE, start_new_session=True)
    (pid,) = map(int, proc.stdout.readline().split())
    os.killpg(proc.pid, signal.SIGINT)   # what a terminal does: the whole foreground process group
    assert proc.stdout.readline() == "interrupted\n"
    out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == ["5", "0"] and not process_alive(pid)
