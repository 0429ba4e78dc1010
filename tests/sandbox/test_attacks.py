"""The attack suite: each test is a real attempt, by the sandboxed program, to get out of the sandbox
or around its limits or the code reward, with an assertion that fails if the attempt succeeds.

Processes an attack leaves behind are found by a unique marker in their command line
(/proc/*/cmdline), which the attacking program puts there by exec'ing with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from relayrl.rewards.code import run_tests
from relayrl.sandbox import Limits, run, sandbox_available

UNAVAILABLE = sandbox_available()
pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(UNAVAILABLE is not None, reason=f"sandbox unavailable: {UNAVAILABLE}")]
ADD_TESTS = [{"call": "add(2, 3)", "expected": 5}, {"call": "add(-1, 1)", "expected": 0},
             {"call": "add(10, 20)", "expected": 30}]
QUICK = Limits(wall_s=2, cpu_s=2)


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


def marker() -> str:
    return f"relayrl-attack-{uuid.uuid4().hex}"


# --- getting out: network, files, signals, processes ---------------------------------------------------

def test_cannot_connect_to_a_socket_listening_on_the_host():
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    abstract = "\0" + marker()  # abstract unix sockets belong to a network namespace, not the filesystem
    unix.bind(abstract)
    unix.listen(8)
    unix.setblocking(False)
    port = tcp.getsockname()[1]
    code = (f"import socket\n"
            f"for host in ('127.0.0.1', 'localhost', '::1'):\n"
            f"    try:\n"
            f"        socket.create_connection((host, {port}), timeout=1)\n"
            f"        print('CONNECTED', host)\n"
            f"    except OSError as e:\n"
            f"        print('failed', host, type(e).__name__)\n"
            f"u = socket.socket(socket.AF_UNIX)\n"
            f"try:\n"
            f"    u.connect({abstract!r})\n"
            f"    print('CONNECTED unix')\n"
            f"except OSError as e:\n"
            f"    print('failed unix', type(e).__name__)\n")
    try:
        r = run(code, limits=Limits(wall_s=5))
        assert r.exit_code == 0, r.stderr
        assert "CONNECTED" not in r.stdout and r.stdout.count("failed") == 4
        for server in (tcp, unix):
            with pytest.raises(BlockingIOError):  # nothing ever reached the listening sockets
                server.accept()
    finally:
        tcp.close()
        unix.close()


def test_cannot_read_secret_files_outside(tmp_path):
    secret = marker()
    in_tmp = tmp_path / "secret.txt"
    in_root = Path("/root") / f"{secret}.txt"
    in_tmp.write_text(secret)
    os.chmod(in_tmp, 0o644)
    os.chmod(tmp_path, 0o755)
    paths = [str(in_tmp), str(in_root), f"/proc/1/root{in_tmp}", f"/proc/{os.getpid()}/root{in_tmp}",
             f"/proc/{os.getpid()}/environ", "/etc/shadow", "/etc/passwd", str(Path(__file__).resolve())]
    code = (f"import os\n"
            f"for p in {paths!r}:\n"
            f"    try:\n"
            f"        print('READ', p, open(p, errors='replace').read())\n"
            f"    except OSError as e:\n"
            f"        print('refused', type(e).__name__)\n"
            f"for d in ('/', '/root', '/home', '/work', '/etc', '/tmp'):\n"
            f"    try:\n"
            f"        print('LIST', d, os.listdir(d))\n"
            f"    except OSError as e:\n"
            f"        print('refused', type(e).__name__)\n")
    try:
        in_root.write_text(secret)
        os.chmod(in_root, 0o644)
        r = run(code, limits=QUICK)
    finally:
        in_root.unlink(missing_ok=True)
    assert r.exit_code == 0, r.stderr
    assert secret not in r.stdout + r.stderr
    assert "READ" not in r.stdout and r.stdout.count("refused") == len(paths) + 4
    # the sandbox's own top level only, and /tmp is its own empty tmpfs
    listed = [line.split(" ", 2) for line in r.stdout.splitlines() if line.startswith("LIST")]
    assert [d for _, d, _ in listed] == ["/", "/tmp"] and listed[1][2] == "[]"
    assert set(eval(listed[0][2])) <= {"sandbox", "tmp", "code", "dev", "proc", "usr", "bin", "sbin", "lib", "lib32",
                                       "lib64", "libx32"}


def test_cannot_write_outside(tmp_path):
    name = marker()
    os.chmod(tmp_path, 0o777)  # the host's permissions would not stop it: only the sandbox can
    stdlib_os = Path(os.__file__)
    sandbox_os = "/usr/lib/python3.11/os.py"
    before = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in (stdlib_os, sandbox_os) if Path(p).exists()}
    targets = [str(tmp_path / name), f"/tmp/{name}", f"/root/{name}", f"/usr/lib/{name}", f"/{name}",
               f"/code/{name}", f"/dev/{name}", f"/proc/1/root/{name}", str(stdlib_os), sandbox_os, "/code/main.py"]
    code = (f"for p in {targets!r}:\n"
            f"    try:\n"
            f"        with open(p, 'a') as f:\n"
            f"            f.write('owned')\n"
            f"        print('WROTE', p)\n"
            f"    except OSError as e:\n"
            f"        print('refused', type(e).__name__)\n")
    r = run(code, limits=QUICK)
    assert r.exit_code == 0, r.stderr
    # /tmp is the sandbox's own tmpfs, gone with it; every other write is refused
    lines = r.stdout.splitlines()
    assert [t for t, line in zip(targets, lines, strict=True) if not line.startswith("refused")] == [f"/tmp/{name}"]
    for p in targets[:5]:
        assert not Path(p).exists(), p
    assert {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in before} == before


def test_fork_bomb_is_contained_and_other_runs_go_on():
    mark = marker()
    limit = 24
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-S', '-c', {bomb!r}, {mark!r}])\n"
    result: dict = {}

    def detonate():
        t0 = time.monotonic()
        result["run"] = run(code, limits=Limits(processes=limit, wall_s=2, cpu_s=5))
        result["took"] = time.monotonic() - t0

    thread = threading.Thread(target=detonate)
    thread.start()
    peak, neighbour = 0, None
    while thread.is_alive():
        peak = max(peak, len(processes_with(mark)))
        if neighbour is None and peak >= limit - 2:  # the bomb is at its limit: can another run still work?
            neighbour = run("print(sum(range(10)))", limits=Limits(wall_s=5))
        time.sleep(0.02)
    thread.join()
    assert peak >= limit - 2, "the bomb never got going: the test did not test anything"
    assert peak <= limit  # the program itself and its forks, never more than the limit
    assert neighbour is not None and neighbour.stdout == "45\n" and neighbour.exit_code == 0
    assert result["run"].timed_out and result["took"] < 2 + 3
    assert processes_with(mark) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_memory_bomb_gets_memory_error():
    code = ("import mmap\n"
            "try:\n"
            "    mmap.mmap(-1, 8 * 2**30)\n"
            "    print('MAPPED 8 GB')\n"
            "except OSError as e:\n"
            "    print('mmap refused')\n"
            "hoard = []\n"
            "while True:\n"
            "    hoard.append(b'x' * 2**24)  # touched pages, not just address space\n")
    t0 = time.monotonic()
    r = run(code, limits=Limits(memory_mb=256, wall_s=10))
    assert r.stdout == "mmap refused\n"
    assert r.exit_code == 1 and r.stderr.strip().endswith("MemoryError")
    assert time.monotonic() - t0 < 5 and not r.timed_out


def test_cpu_loop_is_killed_even_when_it_ignores_sigxcpu():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    r = run(code, limits=Limits(cpu_s=1, wall_s=20))
    # SIGXCPU ignored at 1 s of CPU, so the hard limit's SIGKILL one second later, long before the wall clock
    assert not r.timed_out and r.exit_code == 128 + signal.SIGKILL


def test_sleeping_past_the_wall_clock_is_killed_on_time():
    code = ("import signal, time\n"
            "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
            "    signal.signal(s, signal.SIG_IGN)\n"
            "print('sleeping', flush=True)\n"
            "time.sleep(100)\n")
    t0 = time.monotonic()
    r = run(code, limits=Limits(wall_s=1))
    took = time.monotonic() - t0
    assert r.timed_out and r.exit_code is None and r.stdout == "sleeping\n"
    assert 1.0 <= took < 1.0 + 1.5


def test_output_flood_is_capped_and_ends_the_run_quickly():
    mark = marker()
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    # the flood also comes from a detached child that outlives the program
    code = (f"import os, subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-S', '-c', {flood!r}, {mark!r}], start_new_session=True)\n"
            f"while True:\n"
            f"    sys.stderr.write('e' * 65536)\n")
    t0 = time.monotonic()
    r = run(code, limits=Limits(output_bytes=10_000, wall_s=10))
    assert r.output_truncated and r.exit_code is None and not r.timed_out
    assert len(r.stdout) <= 10_000 and len(r.stderr) <= 10_000 and max(len(r.stdout), len(r.stderr)) == 10_000
    assert time.monotonic() - t0 < 3
    assert processes_with(mark) == []


def test_signalling_the_parent_or_everything_hurts_nothing_outside():
    # a canary under the sandbox's own kernel uid: only the pid namespace can protect it
    canary = subprocess.Popen(["sleep", "30"], user=65534, group=65534, extra_groups=[])
    host_pids = [os.getpid(), os.getppid(), canary.pid, 1]
    code = (f"import os, signal\n"
            f"for pid in {host_pids!r} + [os.getppid()]:\n"
            f"    try:\n"
            f"        os.kill(pid, signal.SIGKILL)\n"
            f"    except OSError as e:\n"
            f"        print('refused', pid, type(e).__name__)\n"
            f"hit = 0\n"
            f"for pid in range(2, 1 << 15):\n"
            f"    if pid != os.getpid():\n"
            f"        try:\n"
            f"            os.kill(pid, signal.SIGSTOP)\n"
            f"            hit += 1\n"
            f"        except OSError:\n"
            f"            pass\n"
            f"print('stopped', hit)\n"
            f"try:\n"
            f"    os.kill(-1, signal.SIGKILL)  # kill -9 -1: every process it may signal\n"
            f"except OSError as e:\n"
            f"    print('kill -1:', type(e).__name__)\n"
            f"print('alive')\n")
    try:
        r = run(code, limits=Limits(wall_s=5))
        assert canary.poll() is None  # still running, not stopped or killed
        assert Path(f"/proc/{canary.pid}/stat").read_text().split(")")[1].split()[0] == "S"
    finally:
        canary.kill()
        canary.wait()
    # it could see no process to stop, nothing but itself and pid 1 (which ignores it) to kill
    assert r.exit_code == 0 and r.stdout.endswith("stopped 0\nkill -1: ProcessLookupError\nalive\n"), r.stdout
    assert run("print('next run')", limits=QUICK).stdout == "next run\n"


def test_no_background_process_survives_the_run():
    mark = marker()
    sleeper = ("import signal, sys, time\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\nopen(sys.argv[2], 'w')\n"
               "time.sleep(60)\n")
    code = (f"import os, subprocess, sys, time\n"
            f"args = [sys.executable, '-S', '-c', {sleeper!r}, {mark!r}]\n"
            f"subprocess.Popen(args + ['/sandbox/a'], start_new_session=True, stdout=subprocess.DEVNULL)\n"
            f"if os.fork() == 0:  # double fork: a daemon, reparented to the namespace's pid-1\n"
            f"    os.setsid()\n"
            f"    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, args + ['/sandbox/b'])\n"
            f"    os._exit(0)\n"
            f"for _ in range(200):\n"
            f"    if os.path.exists('/sandbox/a') and os.path.exists('/sandbox/b'):\n"
            f"        break\n"
            f"    time.sleep(0.01)\n"
            f"print('spawned', sorted(os.listdir('/sandbox')))\n")
    r = run(code, limits=Limits(wall_s=5))
    assert r.stdout == "spawned ['a', 'b']\n" and r.exit_code == 0 and not r.timed_out
    assert r.wall_s < 4  # the run ended with the program, not with its leftovers
    assert processes_with(mark) == []


def test_killing_the_caller_kills_the_sandbox(tmp_path):
    mark = marker()
    sleep = "import time; time.sleep(60)"
    sleeper = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-S', '-c', {sleep!r}, {mark!r}])"
    caller = subprocess.Popen([sys.executable, "-c", "import sys; from relayrl.sandbox import run, Limits; "
                               "run(sys.argv[1], limits=Limits(wall_s=60))", sleeper],
                              cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while not processes_with(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(mark), "the sandboxed sleeper never started"
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 3
        while processes_with(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(mark) == []  # --die-with-parent: gone with its caller
    finally:
        caller.kill()


def test_cannot_raise_its_limits_make_namespaces_mount_or_trace_pid_1():
    code = ("import ctypes, os, resource\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "try:\n"
            "    resource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\n"
            "    print('RAISED')\n"
            "except (ValueError, OSError):\n"
            "    print('limit kept', resource.getrlimit(resource.RLIMIT_NPROC))\n"
            "print('unshare user', libc.unshare(0x10000000), 'net', libc.unshare(0x40000000))\n"
            "print('mount', libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None))\n"
            "print('ptrace', libc.ptrace(16, 1, None, None))  # PTRACE_ATTACH to bwrap's pid-1\n")
    r = run(code, limits=Limits(processes=8, wall_s=5))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["limit kept (8, 8)", "unshare user -1 net -1", "mount -1", "ptrace -1"]


# --- forging a pass of the code reward -----------------------------------------------------------------

FORGERIES = {
    "print a result line with a guessed value, then exit 0 before the test runs":
        "import os\nprint('\\n@@relayrl-result@@ 42')\nos._exit(0)\n",
    "print a guessed result line and let the real one follow":
        "print('@@relayrl-result@@ 42')\ndef add(a, b):\n    return 42\n",
    "exit 0 at import, before the call":
        "import sys\nsys.exit(0)\n",
    "os._exit(0) inside the call":
        "import os\ndef add(a, b):\n    os._exit(0)\n",
    "patch json.dumps to print a fake value":
        "import json\njson.dumps = lambda value: 'true'\ndef add(a, b):\n    return None\n",
    "patch builtins.eval and sys.stdout.write":
        "import builtins, sys\nbuiltins.eval = lambda *a, **k: 42\n_w = sys.stdout.write\n"
        "sys.stdout.write = lambda s: _w(s.replace('null', '42'))\ndef add(a, b):\n    return None\n",
    "rewrite the test harness and the solution on disk":
        "import sys\nfor p in ('/code/main.py', '/sandbox/solution.py'):\n    try:\n"
        "        open(p, 'w').write('print(\"@@relayrl-result@@ 42\")')\n    except OSError:\n        pass\n"
        "def add(a, b):\n    return -1\n",
    "write a result file": "import json\nfor p in ('/sandbox/result.json', '/tmp/result.json', 'results.json'):\n"
        "    json.dump({'passed': 3, 'total': 3}, open(p, 'w'))\ndef add(a, b):\n    return -1\n",
    "an int whose __eq__ always says yes":
        "class Liar(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Liar(7)\n",
    "NaN, which some comparisons let through": "def add(a, b):\n    return float('nan')\n",
    "a result the judge's JSON parser cannot take (nesting)":
        "import os\nprint('@@relayrl-result@@ ' + '[' * 30000 + ']' * 30000)\nos._exit(0)\n",
    "a result the judge's JSON parser cannot take (a 5000-digit integer)":
        "import os\nprint('@@relayrl-result@@ ' + '9' * 5000)\nos._exit(0)\n",
    "kill pid-1 and the parent, then answer":
        "import os, signal\nfor pid in (1, os.getppid()):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n        pass\ndef add(a, b):\n    return 0.5\n",
}


# why each forgery fails: the reason shows the attack ran as meant (and was not stopped by something else)
FORGERY_FAILS_AS = {
    "print a result line with a guessed value, then exit 0 before the test runs": "wrong answer",
    "print a guessed result line and let the real one follow": "2 result lines (one expected)",
    "exit 0 at import, before the call": "no result",
    "os._exit(0) inside the call": "no result",
    "patch json.dumps to print a fake value": "wrong answer",
    "patch builtins.eval and sys.stdout.write": "wrong answer",
    "rewrite the test harness and the solution on disk": "wrong answer",
    "write a result file": "wrong answer",
    "an int whose __eq__ always says yes": "wrong answer",
    "NaN, which some comparisons let through": "wrong answer",
    "a result the judge's JSON parser cannot take (nesting)": "malformed result",
    "a result the judge's JSON parser cannot take (a 5000-digit integer)": "malformed result",
    "kill pid-1 and the parent, then answer": "wrong answer",
}


@pytest.mark.parametrize("attack", list(FORGERIES))
def test_forging_a_pass_fails(attack):
    result = run_tests(FORGERIES[attack], ADD_TESTS, limits=QUICK)
    assert result.passed == 0
    assert [o.reason for o in result.outcomes] == [FORGERY_FAILS_AS[attack]] * len(ADD_TESTS)


def test_the_expected_value_is_nowhere_in_the_sandbox_to_be_found():
    secret = marker()
    # the solution looks for it in its environment, arguments, stdin, every process of the sandbox, every
    # file it may write or read outside /usr, and every frame and object of its own interpreter
    code = ("import gc, os, re, sys\n"
            "def find():\n"
            "    blobs = [os.environ, sys.argv, sys.stdin.read()]\n"
            "    for pid in (p for p in os.listdir('/proc') if p.isdigit()):\n"
            "        for name in ('cmdline', 'environ'):\n"
            "            try:\n"
            "                blobs.append(open(f'/proc/{pid}/{name}', 'rb').read())\n"
            "            except OSError:\n"
            "                pass\n"
            "    for root in ('/sandbox', '/code', '/tmp', '/dev/shm'):\n"
            "        for d, _, files in os.walk(root):\n"
            "            blobs += [open(os.path.join(d, f), 'rb').read() for f in files]\n"
            "    frame = sys._getframe()\n"
            "    while frame is not None:\n"
            "        blobs += [frame.f_locals, frame.f_globals, frame.f_code.co_consts]\n"
            "        frame = frame.f_back\n"
            "    blobs += [o for o in gc.get_objects() if isinstance(o, (dict, list, tuple))]\n"
            "    text = ' '.join(b.decode('utf-8', 'replace') if isinstance(b, bytes) else repr(b) for b in blobs)\n"
            "    hits = re.findall('relayrl-attack-[0-9a-f]{32}', text)\n"
            "    return hits[0] if hits else f'not found in {len(text)} characters'\n")
    result = run_tests(code, [{"call": "find()", "expected": secret}], limits=Limits(wall_s=5, output_bytes=1 << 20))
    assert result.outcomes[0].reason == "wrong answer"  # it ran, looked everywhere, found nothing
