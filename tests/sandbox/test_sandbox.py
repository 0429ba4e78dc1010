"""The sandbox's ordinary behaviour: output, exit status, files, stdin, environment and each limit,
checked on real bubblewrap runs (skipped, with the reason, where the sandbox cannot run).
Attacks on it are in test_attacks.py."""

from __future__ import annotations

import threading
import time

import pytest

from relayrl.errors import ConfigError, UserError
from relayrl.sandbox import Limits, SandboxUnavailable, availability, bwrap, run, sandbox_available

UNAVAILABLE = sandbox_available()
needs_sandbox = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"sandbox unavailable: {UNAVAILABLE}")
QUICK = Limits(wall_s=3)


@pytest.mark.unit
@needs_sandbox
def test_stdout_stderr_and_exit_code():
    r = run("import sys\nprint('out', 1)\nprint('err', file=sys.stderr)\nsys.exit(3)", limits=QUICK)
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.output_truncated) == ("out 1\n", "err\n", 3, False, False)
    assert not r.ok and r.describe() == "exit 3"
    ok = run("print('fine')", limits=QUICK)
    assert ok.ok and ok.exit_code == 0 and 0 < ok.wall_s < 3


@pytest.mark.unit
@needs_sandbox
def test_an_exception_gives_exit_1_and_a_traceback_of_the_program_only():
    r = run("def f(x):\n    return 1 / x\nf(0)\n", limits=QUICK)
    assert r.exit_code == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == '  File "/code/main.py", line 3, in <module>'  # no launcher frame before it
    assert lines[-1] == "ZeroDivisionError: division by zero"
    syntax = run("def f(:\n", limits=QUICK)
    assert syntax.exit_code == 1 and syntax.stderr.strip().splitlines()[-1].startswith("SyntaxError")


@pytest.mark.unit
@needs_sandbox
def test_files_are_in_the_working_directory_and_importable():
    files = {"helper.py": "VALUE = 42\n", "data/input.bin": b"\x00\xffraw", "notes.txt": "h\u00e9llo"}
    code = ("import os, helper\n"
            "print(os.getcwd(), helper.VALUE)\n"
            "print(sorted(os.path.join(d, f) for d, _, fs in os.walk('.') for f in fs))\n"
            "print(open('data/input.bin', 'rb').read(), open('notes.txt', encoding='utf-8').read())\n")
    r = run(code, files=files, limits=QUICK)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["/sandbox 42", "['./data/input.bin', './helper.py', './notes.txt']",
                                     "b'\\x00\\xffraw' h\u00e9llo"]
    # each run starts from its own empty working directory
    again = run("import os; print(os.listdir('.'))", limits=QUICK)
    assert again.stdout == "[]\n"


@pytest.mark.unit
@needs_sandbox
def test_stdin_is_given_to_the_program():
    r = run("import sys\nfor line in sys.stdin: print(line.strip()[::-1])", stdin="abc\nxyz\n", limits=QUICK)
    assert r.stdout == "cba\nzyx\n"
    empty = run("import sys; print(repr(sys.stdin.read()))", limits=QUICK)
    assert empty.stdout == "''\n"


@pytest.mark.unit
@needs_sandbox
def test_environment_is_cleared_and_no_site_packages_are_reachable():
    code = ("import os, sys\n"
            "print(sorted(os.environ))\n"
            "print('site' in sys.modules, any('packages' in p for p in sys.path))\n"
            "print(os.getuid() != 0, open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
            "print(os.listdir('/usr/lib/python3/dist-packages') if os.path.isdir('/usr/lib/python3/dist-packages') "
            "else [])\n")
    r = run(code, limits=QUICK)
    assert r.exit_code == 0, r.stderr
    env, site, ids, packages = r.stdout.splitlines()
    # PATH/HOME/TMPDIR are set by relayrl; PWD by bubblewrap's --chdir, LC_CTYPE by Python's C-locale coercion
    assert set(eval(env)) <= {"PATH", "HOME", "TMPDIR", "PWD", "LC_CTYPE"}
    assert site == "False False"
    assert ids == "True 0000000000000000"  # not root, no capabilities
    assert packages == "[]"


@pytest.mark.faults
@needs_sandbox
def test_wall_clock_marks_the_run_timed_out_and_keeps_output_written_before():
    t0 = time.monotonic()
    r = run("import time\nprint('started')\ntime.sleep(30)\nprint('never')", limits=Limits(wall_s=1))
    took = time.monotonic() - t0
    assert r.timed_out and r.exit_code is None and not r.ok
    assert r.stdout == "started\n"
    assert 1.0 <= took < 2.5 and 1.0 <= r.wall_s < 2.5
    assert r.describe().startswith("timeout")


@pytest.mark.faults
@needs_sandbox
def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock():
    r = run("while True:\n    pass", limits=Limits(cpu_s=1, wall_s=20))
    assert not r.timed_out and r.exit_code == 128 + 24 and r.describe() == "killed by SIGXCPU"


@pytest.mark.faults
@needs_sandbox
def test_memory_limit_refuses_an_allocation_past_it_and_allows_one_below():
    code = "import sys\nx = bytearray(int(sys.stdin.read()) * 2**20)\nprint(len(x) // 2**20)"
    assert run(code, stdin="100", limits=Limits(memory_mb=256, wall_s=5)).stdout == "100\n"
    big = run(code, stdin="300", limits=Limits(memory_mb=256, wall_s=5))
    assert big.exit_code == 1 and big.stderr.strip().endswith("MemoryError")


@pytest.mark.unit
@needs_sandbox
def test_file_size_limit_stops_a_file_at_the_limit():
    code = ("import os\n"
            "try:\n"
            "    with open('big', 'wb') as f:\n"
            "        f.write(b'x' * (3 * 2**20))\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "print(os.path.getsize('big'))\n")
    r = run(code, limits=Limits(file_size_mb=2, wall_s=5))
    assert r.stdout.splitlines() == ["refused 27", str(2 * 2**20)]  # EFBIG, and not a byte more


@pytest.mark.unit
@needs_sandbox
def test_disk_limit_bounds_the_working_directory():
    code = ("n = 0\n"
            "try:\n"
            "    while True:\n"
            "        with open(f'f{n}', 'wb') as f:\n"
            "            f.write(b'x' * 2**20)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    import os\n"
            "    print(n, e.errno, sum(os.path.getsize(p) for p in os.listdir('.')))\n")
    r = run(code, limits=Limits(disk_mb=8, file_size_mb=4, wall_s=5))
    whole_files, errno, total = map(int, r.stdout.split())
    assert errno == 28 and whole_files == 8 and total == 8 * 2**20  # ENOSPC once 8 MB are in, not a byte more


@pytest.mark.unit
@needs_sandbox
def test_open_files_limit():
    code = ("fs = []\n"
            "try:\n"
            "    while True:\n"
            "        fs.append(open('/dev/null'))\n"
            "except OSError as e:\n"
            "    print(len(fs), e.errno)\n")
    r = run(code, limits=Limits(open_files=20, wall_s=5))
    opened, errno = map(int, r.stdout.split())
    assert errno == 24 and 10 <= opened < 20  # EMFILE; stdin/out/err and Python's own count too


@pytest.mark.unit
@needs_sandbox
def test_process_limit_bounds_forks_of_one_run():
    code = ("import os, time\n"
            "n = 0\n"
            "for _ in range(200):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(5)\n"
            "        os._exit(0)\n"
            "    n += 1\n"
            "print(n)\n")
    r = run(code, limits=Limits(processes=16, wall_s=5))
    # 16 processes in the run's namespace: bubblewrap's pid-1 and the program itself are two of them
    assert r.exit_code == 0 and int(r.stdout) == 14


@pytest.mark.unit
@needs_sandbox
def test_output_cap_keeps_exactly_output_bytes_and_marks_truncation():
    exact = run("import sys; sys.stdout.write('y' * 1000)", limits=Limits(output_bytes=1000, wall_s=3))
    assert exact.stdout == "y" * 1000 and not exact.output_truncated and exact.exit_code == 0
    over = run("import sys; sys.stdout.write('y' * 1001)", limits=Limits(output_bytes=1000, wall_s=3))
    assert over.stdout == "y" * 1000 and over.output_truncated and over.exit_code is None
    err = run("import sys; sys.stderr.write('e' * 5000)", limits=Limits(output_bytes=1000, wall_s=3))
    assert err.stderr == "e" * 1000 and err.output_truncated and err.describe() == "output limit exceeded"


@pytest.mark.unit
@needs_sandbox
def test_concurrent_runs_each_get_their_own_output_and_process_budget():
    code = ("import os, sys, time\n"
            "kids = []\n"
            "for _ in range(10):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        time.sleep(0.5)\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "for pid in kids:\n"
            "    os.waitpid(pid, 0)\n"
            "print(sys.stdin.read(), len(kids))\n")
    results: dict[int, object] = {}

    def one(i: int) -> None:
        results[i] = run(code, stdin=str(i), limits=Limits(processes=12, wall_s=10))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 4 runs x 11 processes under one uid at once, each within its limit of 12: none starved another
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i} 10\n" for i in range(4)}


@pytest.mark.unit
def test_limits_are_validated_with_one_line_naming_the_limit():
    with pytest.raises(ConfigError, match="wall_s must be a positive"):
        Limits(wall_s=0)
    with pytest.raises(ConfigError, match="processes must be a number"):
        Limits(processes=True)
    with pytest.raises(ConfigError, match="cpu_s must be a whole number"):
        Limits(cpu_s=1.5)
    with pytest.raises(ConfigError, match="memory_mb must be a positive finite"):
        Limits(memory_mb=float("inf"))
    assert Limits().rlimits() == {"CPU": 5, "AS": 512 * 2**20, "NPROC": 64, "FSIZE": 16 * 2**20, "NOFILE": 64}


@pytest.mark.unit
@needs_sandbox
@pytest.mark.parametrize("name", ["/etc/passwd", "../escape.py", "a/../../b", "", "a//b", "./x"])
def test_file_names_must_stay_inside_the_working_directory(name):
    with pytest.raises(ValueError, match="sandbox file name"):
        run("pass", files={name: "x"})


@pytest.mark.unit
@needs_sandbox
def test_file_contents_must_be_text_or_bytes():
    with pytest.raises(TypeError, match="sandbox file 'n.txt' must be str or bytes, not int"):
        run("pass", files={"n.txt": 5})


@pytest.mark.unit
def test_without_bwrap_run_raises_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    availability.sandbox_available.cache_clear()
    try:
        reason = sandbox_available()
        assert reason is not None and "apt-get install bubblewrap" in reason and "\n" not in reason
        with pytest.raises(SandboxUnavailable) as e:
            run("print(1)")
        assert isinstance(e.value, UserError) and str(e.value) == reason
    finally:
        availability.sandbox_available.cache_clear()


@pytest.mark.unit
def test_an_interpreter_closed_to_the_sandbox_user_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: "/usr/bin/bwrap")
    monkeypatch.setattr(bwrap, "bwrap_options", lambda path: frozenset(availability._REQUIRED_OPTIONS))
    monkeypatch.setattr(bwrap, "find_interpreter", lambda: None)
    availability.sandbox_available.cache_clear()
    try:
        reason = sandbox_available()
        assert reason is not None and "python3" in reason and "\n" not in reason
    finally:
        availability.sandbox_available.cache_clear()


@pytest.mark.unit
def test_an_old_bwrap_is_refused_naming_what_it_lacks(monkeypatch):
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: "/usr/bin/bwrap")
    monkeypatch.setattr(bwrap, "bwrap_options", lambda path: frozenset({"--unshare-all", "--info-fd", "--block-fd"}))
    availability.sandbox_available.cache_clear()
    try:
        reason = sandbox_available()
        assert reason is not None and "--size, --disable-userns" in reason and "too old" in reason
    finally:
        availability.sandbox_available.cache_clear()
