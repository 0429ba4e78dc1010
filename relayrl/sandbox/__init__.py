"""Running untrusted, model-written Python under bubblewrap, with limits on everything it may use.

    from relayrl.sandbox import run, Limits
    result = run("print(input()[::-1])", stdin="abc", limits=Limits(wall_s=2))
    result.stdout, result.exit_code, result.timed_out      # 'cba\\n', 0, False

`run` raises `SandboxUnavailable` (a UserError: one line, naming `apt-get install bubblewrap`) where
bubblewrap is missing or the kernel refuses it namespaces; `sandbox_available()` says so without
raising. What the program sees and how each limit is enforced: `relayrl.sandbox.bwrap` and
`relayrl.sandbox.limits`; how a run is supervised and cleaned up: `relayrl.sandbox.runner`.

The package imports the standard library and relayrl.errors only: it is a leaf layer, and must never
import another relayrl layer (rewards and envs import it, not the other way round).
"""

from relayrl.sandbox.availability import SandboxUnavailable, require_sandbox, sandbox_available
from relayrl.sandbox.limits import Limits
from relayrl.sandbox.result import RunResult
from relayrl.sandbox.runner import run

__all__ = ["Limits", "RunResult", "SandboxUnavailable", "require_sandbox", "run", "sandbox_available"]
