"""This script is the first thing that runs inside the sandbox, as its pid 1: it applies the run's
resource limits, forks the untrusted program (pid 2, run as `__main__` in a fresh copy of this
interpreter), reaps every process of the sandbox, and exits with the program's status, at which point
the kernel kills whatever the program left behind.

The host never imports it: `relayrl.sandbox.bwrap` passes its source to the sandboxed interpreter
with `-c`, followed by the limits as NAME=VALUE arguments and the path of the program.

Why pid 1 is this script, not bubblewrap's own reaper: every process of the sandbox must be held to
the limits, and bubblewrap's reaper is not (the program could ptrace it, make it allocate or fork
without bound). This pid 1 sets the limits before it forks, and makes itself non-dumpable so that
the program (the same uid) can neither ptrace it nor read its memory; and pid 1 of a pid namespace
ignores every signal sent from inside it that it has no handler for, SIGKILL included.

Why limits are set here and not before bubblewrap starts: RLIMIT_NPROC counts processes per user
*namespace* only when it is set inside the run's own namespace. Set outside, every concurrent run
(all under the same unprivileged uid) would draw on one shared count, and a fork bomb in one would
starve the rest.

It must run on any Python 3.9+ the sandbox offers and import the standard library only.
"""

import ctypes
import os
import resource
import signal
import sys

PR_SET_DUMPABLE = 4


def _main(argv):
    *limit_args, program = argv[1:]
    # Descriptors bubblewrap or the host leave open are no business of the program.
    os.closerange(3, 1 << 16)
    _set_limits(limit_args)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed: pid 1 would be open to ptrace")
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the program's own /proc/self stays its own
        _run_program(program)
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # so that pid 1 ignores it too
    while True:
        pid, status = os.wait()  # reaps orphans too: no zombie counts against RLIMIT_NPROC
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)  # a shell's status: 128 + N for signal N


def _set_limits(limit_args):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for arg in limit_args:
        name, _, value = arg.partition("=")
        which = getattr(resource, "RLIMIT_" + name)
        soft = int(value)
        # CPU: SIGXCPU at the soft limit, and SIGKILL one second later should the program catch it
        hard = soft + 1 if name == "CPU" else soft
        # A caller may already be limited (a reward worker sets RLIMIT_AS and RLIMIT_CPU): never ask
        # for more than it has, which an unprivileged process may not.
        inherited = resource.getrlimit(which)[1]
        if inherited != resource.RLIM_INFINITY:
            soft, hard = min(soft, inherited), min(hard, inherited)
        resource.setrlimit(which, (soft, hard))


def _run_program(program):
    # Bound now: clearing __main__ below also clears this module's globals.
    exit_, builtins_, modules = sys.exit, __builtins__, sys.modules
    with open(program, encoding="utf-8") as f:
        source = f.read()
    sys.argv = [program]
    sys.path[0] = os.getcwd()  # `import helper` finds the run's files, as `python main.py` would
    namespace = modules["__main__"].__dict__  # pickle and multiprocessing look classes up in __main__
    namespace.clear()
    namespace.update(__name__="__main__", __file__=program, __builtins__=builtins_, __doc__=None,
                     __loader__=None, __spec__=None, __package__=None)
    try:
        exec(compile(source, program, "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as e:
        # The traceback starts at the program: the launcher's own frames are noise to whoever reads it.
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        exit_(1)


if __name__ == "__main__":  # as `python -c` runs it; importing this module on the host does nothing
    _main(sys.argv)
