"""The rank zygote (``megatron_ext/ft/zygote.py``): a forked rank behaves as a fresh interpreter
would -- its script as ``__main__`` with its argv, path, directory and environment, its output
captured, its exit code as ``Popen`` reports it, the interpreter's exit steps -- and the launcher's
results are the same forked or spawned."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from megatron_ext.ft import zygote as zg

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(),
                      "path0": sys.path[0], "var": os.environ.get("ZYGOTE_TEST_VAR"),
                      "stdin": sys.stdin.read()}), flush=True)
    mode = sys.argv[1]
    atexit.register(lambda: print("atexit ran", flush=True))
    if mode == "thread":
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    elif mode == "exit3":
        sys.exit(3)
    elif mode == "exitmsg":
        sys.exit("a message")
    elif mode == "raise":
        raise ValueError("boom in the rank")
    elif mode == "hard":
        os._exit(5)
    elif mode == "sleep":
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def zygote():
    z = zg.zygote_for({**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    if z is None:
        pytest.skip(f"{zg.START_ENV}=spawn")
    return z


def _run(zygote, tmp_path, mode, **env):
    script = tmp_path / "rank_script.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    out = str(tmp_path / f"{mode}.log")
    rank = zygote.start([str(script), mode], {**os.environ, "ZYGOTE_TEST_VAR": "seven", **env}, str(work), out)
    code = rank.wait(60)
    text = rank.output()
    return code, json.loads(text.splitlines()[0]), text


def test_a_forked_rank_is_its_script_as_main(zygote, tmp_path):
    code, seen, text = _run(zygote, tmp_path, "ok")
    assert code == 0
    assert seen == {"name": "__main__", "file": str(tmp_path / "rank_script.py"),
                    "argv": [str(tmp_path / "rank_script.py"), "ok"], "cwd": str(tmp_path / "work"),
                    "path0": str(tmp_path), "var": "seven", "stdin": ""}
    assert "atexit ran" in text


@pytest.mark.parametrize("mode, want, line", [("exit3", 3, None), ("exitmsg", 1, "a message"),
                                              ("raise", 1, "ValueError: boom in the rank"), ("hard", 5, None),
                                              ("thread", 0, "thread done")])
def test_exit_codes_and_exit_steps_as_an_interpreter(zygote, tmp_path, mode, want, line):
    code, _, text = _run(zygote, tmp_path, mode)
    assert code == want, text
    if line is not None:
        assert line in text
    # os._exit skips the exit steps, as it does in any interpreter; a thread is joined before them.
    assert ("atexit ran" in text) == (mode != "hard")
    if mode == "thread":
        assert text.index("thread done") < text.index("atexit ran")


def test_a_killed_rank_reports_the_signal(zygote, tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    rank = zygote.start([str(script), "sleep"], dict(os.environ), None, str(tmp_path / "k.log"))
    assert rank.poll() is None
    rank.kill()
    assert rank.wait(30) == -signal.SIGKILL


def test_forkable_arguments():
    assert zg.forkable(["pretrain_gpt.py", "--x"]) and zg.forkable(["-c", "print(1)"])
    assert not zg.forkable(["-m", "torch.distributed.run"]) and not zg.forkable(["-c"])
    assert not zg.forkable([]) and not zg.forkable(["-u", "x.py"])


def test_the_launcher_gives_the_same_results_forked_and_spawned(monkeypatch):
    from megatron_ext.ft.launch import launch_ranks

    script = ("import os, sys; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], sys.argv[1:]); "
              "sys.exit(int(os.environ['RANK']) * 2)")
    results = {}
    for start in ("fork", "spawn"):
        monkeypatch.setenv(zg.START_ENV, start)
        results[start] = [(r.rank, r.returncode, r.output.strip(), r.incarnations)
                          for r in launch_ranks(["-c", script, "a", "b"], 3, timeout_s=120)]
    assert results["fork"] == results["spawn"] == [
        (r, 2 * r, f"rank {r} of 3 ['a', 'b']", [2 * r]) for r in range(3)]


def test_ranks_of_a_zygote_that_dies_are_reported_lost_and_the_next_start_refused(tmp_path):
    z = zg.Zygote({**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "ZYGOTE_TEST_OWN": "1"})
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    rank = z.start([str(script), "sleep"], dict(os.environ), None, str(tmp_path / "d.log"))
    z.proc.kill()
    z.proc.wait()
    assert rank.wait(30) == -signal.SIGKILL
    os.kill(rank.pid, signal.SIGKILL)  # the orphan
    with pytest.raises(RuntimeError, match="zygote"):
        z.start([str(script), "ok"], dict(os.environ), None, None)
    assert not z.alive()


def test_launches_differing_only_in_volatile_variables_share_a_zygote_and_the_oldest_is_closed(monkeypatch):
    # Under pytest, PYTEST_CURRENT_TEST changes with every test and RANK / MASTER_PORT with every
    # launch: keyed on them, each test would start (and keep) a zygote of its own.
    monkeypatch.setattr(zg, "_zygotes", {})
    monkeypatch.setattr(zg, "MAX_ZYGOTES", 1)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "ZYGOTE_TEST_KEY": "a"}
    first = zg.zygote_for({**env, "PYTEST_CURRENT_TEST": "t1", "RANK": "0", "MASTER_PORT": "1"})
    try:
        assert zg.zygote_for({**env, "PYTEST_CURRENT_TEST": "t2", "RANK": "3", "MASTER_PORT": "2"}) is first
        assert zg.zygote_for({**env, "RANK": "1"}) is first
        other = zg.zygote_for({**env, "ZYGOTE_TEST_KEY": "b"})
        assert other is not first and list(zg._zygotes.values()) == [other]
        assert first.proc.wait(120) == 0          # closed: it ends once it has no child left
        assert other.alive()
    finally:
        for z in (first, *zg._zygotes.values()):
            z.close()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_launch_past_its_timeout_is_killed_with_what_it_started(start, monkeypatch):
    from tests.conftest import _child_env, launch_python

    monkeypatch.setenv(zg.START_ENV, start)
    child = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print('grandchild', p.pid, flush=True); time.sleep(120)")
    with pytest.raises(subprocess.TimeoutExpired) as err:
        launch_python(["-c", child], _child_env({"OMP_NUM_THREADS": "1"}), timeout=5, merge=True)
    words = err.value.output.split()
    assert "grandchild" in words, err.value.output
    pid = int(words[words.index("grandchild") + 1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break                                     # gone
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the launch's own child {pid} outlived its timeout")
