"""This package is the `relayrl` command line: thin entry points that parse their arguments, build, run
and close (relayrl.cli.main).

The CLI is the top layer: it may import any relayrl layer, and no relayrl module may import it.
"""
