"""This script is the first thing that runs inside the sandbox: it applies the run's resource limits,
then runs the untrusted program as `__main__` in the same interpreter.

The host never imports it: `relayrl.sandbox.bwrap` passes its source to the sandboxed interpreter
with `-c`, followed by the limits as NAME=VALUE arguments and the path of the program. Why limits
are set here and not before bubblewrap starts: RLIMIT_NPROC counts processes per user *namespace*
only when it is set inside the run's own namespace. Set outside, every concurrent run (all under the
same unprivileged uid) would draw on one shared count, and a fork bomb in one would starve the rest.

It must run on any Python 3.8+ the sandbox offers and import the standard library only.
"""

import os
import resource
import sys


def _main(argv):
    *limit_args, program = argv[1:]
    # Bound now: clearing __main__ below also clears this function's globals.
    exit_, builtins_, modules = sys.exit, __builtins__, sys.modules
    # Descriptors bubblewrap or the host leave open are no business of the program.
    os.closerange(3, 1 << 16)
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
        # The traceback starts at the program: the launcher's own frame is noise to whoever reads it.
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        exit_(1)


if __name__ == "__main__":  # as `python -c` runs it; importing this module on the host does nothing
    _main(sys.argv)
