"""The layering of ../shared/DESIGN.md, checked: no module imports a layer above its own, and loading a
run's config imports config modules only.

The order is written here as data (which layers each layer may import), parsed from every module's
import statements (top-level and inside functions alike), and shown to fail on a deliberately added
upward import in a temporary package tree.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "relayrl"

GROUND = {"config", "errors", "lazy"}  # relayrl/config.py, errors.py, lazy.py: every layer may use them
LEAVES = ("models", "parallel", "algorithms", "sandbox", "data", "observe")  # torch and the standard library only
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "lazy": set(),
    "config": {"errors"},
    **{leaf: set(GROUND) for leaf in LEAVES},
    # generic: knows nothing of RL; traces its calls; a process it starts hands its models their CPU kernels
    # (process_setup: decided by parallel.cpu_kernels, taken by models.linear / pointwise as an argument)
    "single_controller": GROUND | {"parallel", "observe", "models"},
    "rewards": GROUND | {"sandbox", "data"},
    "envs": GROUND | {"rewards", "sandbox", "data"},
    "checkpoint": GROUND | {"parallel", "models"},
    "sync": GROUND | {"models", "parallel"},  # never the trainer or the engine: it is handed plain tensors
    "engine": GROUND | {"models", "single_controller"},  # its tensor-parallel ranks are a worker group
    "trainer": GROUND | {"parallel", "models", "algorithms", "checkpoint"},
    "planner": GROUND | {"models", "sync"},  # shapes and layouts as data: no devices, no trainer, no engine
}
# the RL application, by concern: producing samples, where roles run, the loop, the jobs that build and run it
ALLOWED["rollout"] = GROUND | {"engine", "envs", "rewards", "data", "models", "observe", "algorithms"}
# the OpenAI-compatible endpoint: a front of the rollout side (the engine, the chat format and tool-call parser), and
# the agent functions' runner behind it (an EpisodeRunner: the rollout's trajectory and reward settling, user
# functions loaded as rewards are); the rollout layer never imports it (roles build the runner, lazily)
ALLOWED["serve"] = GROUND | {"engine", "envs", "data", "models", "rewards", "rollout"}
ALLOWED["roles"] = set(ALLOWED) - {"planner"}  # roles run the rollout side too (a rollout worker's agent loop)
# the loop is typed against the protocols below it and takes its batches from a rollout source; it never builds
# or places a role (that is the jobs')
ALLOWED["controller"] = set(ALLOWED) - {"roles", "planner"}
ALLOWED["jobs"] = set(ALLOWED) - {"jobs"}
ALLOWED["cli"] = set(ALLOWED) - {"cli"}


def imported_layers(path: Path, root: Path) -> set[str]:
    """The relayrl layers a module imports (absolute `relayrl.x` imports; relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root.parent).parts[:-1]  # ("relayrl", "sync") for relayrl/sync/plan.py
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from ..x import y: relative to the module's own package
                base = list(package[: len(package) - node.level + 1])
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "relayrl" and len(parts) > 1:
                found.add(parts[1])
    return found


def layer_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def upward_imports(root: Path) -> list[str]:
    """'module imports relayrl.layer' for every import the order forbids (and every unknown layer)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        layer = layer_of(path, root)
        if layer == "__init__":
            continue
        if layer not in ALLOWED:
            bad.append(f"{path.relative_to(root.parent)} is in a layer the order does not know: {layer}")
            continue
        for other in sorted(imported_layers(path, root) - {layer}):
            if other not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(root.parent)} imports relayrl.{other}")
    return bad


@pytest.mark.unit
def test_no_layer_imports_a_layer_above_it():
    assert upward_imports(ROOT) == []


@pytest.mark.unit
def test_the_check_fails_on_an_upward_import(tmp_path):
    pkg = tmp_path / "relayrl"
    for layer in ("models", "trainer", "sync"):
        (pkg / layer).mkdir(parents=True)
        (pkg / layer / "__init__.py").write_text("")
    (pkg / "models" / "fine.py").write_text("from relayrl.config import Config\nimport torch\n")
    (pkg / "trainer" / "fine.py").write_text("from relayrl.models.fine import Config\n")
    assert upward_imports(pkg) == []
    # a model module reaching up into the trainer, one inside a function, and a relative one from sync
    (pkg / "models" / "bad.py").write_text("from relayrl.trainer.fine import Config\n")
    (pkg / "models" / "lazy_bad.py").write_text("def f():\n    import relayrl.jobs.train\n")
    (pkg / "sync" / "bad.py").write_text("from ..trainer import fine\n")
    assert upward_imports(pkg) == [
        "relayrl/models/bad.py imports relayrl.trainer",
        "relayrl/models/lazy_bad.py imports relayrl.jobs",
        "relayrl/sync/bad.py imports relayrl.trainer",
    ]


def _loaded_after(code: str) -> tuple[list[str], str]:
    """The modules a fresh interpreter holds after `code` (relayrl's and the heavy third-party ones), and what
    `code` printed before them."""
    probe = ("; import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith('relayrl') "
             "or m in ('torch', 'transformers', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code + probe], cwd=ROOT.parent, capture_output=True, text=True,
                         check=True)
    *before, last = out.stdout.strip().splitlines()
    return json.loads(last), "\n".join(before)


@pytest.mark.unit  # a fresh interpreter loads a shipped config (no torch: a fraction of a second)
def test_loading_a_run_config_imports_config_modules_only():
    """RunConfig composes each layer's config section: loading it must not import torch, the engine, the
    trainer, checkpoints, worker groups or the weight sync (a typo in a YAML file is reported at once)."""
    loaded, _ = _loaded_after("from relayrl.controller.config import load_run_config; "
                              "load_run_config('configs/grpo_arith.yaml', ['trainer.lr=3e-3'])")
    assert "relayrl.controller.config" in loaded
    assert "torch" not in loaded and "transformers" not in loaded
    # config modules (`config`, or `<thing>_config` beside a module of that thing: models.lora_config), the
    # package __init__s on their way, the registry names are checked against (it knows the built-in names
    # without importing their modules), and the built-in tasks (pure functions of the standard library)
    allowed_prefixes = ("relayrl.data",)
    allowed = {"relayrl", "relayrl.config", "relayrl.errors", "relayrl.lazy", "relayrl.controller",
               "relayrl.algorithms", "relayrl.algorithms.registry", "relayrl.envs", "relayrl.models",
               "relayrl.parallel", "relayrl.rewards", "relayrl.rollout", "relayrl.sync", "relayrl.trainer"}
    stray = [m for m in loaded if m not in ("torch", "transformers", "numpy")
             and m not in allowed and not m.endswith((".config", "_config")) and not m.startswith(allowed_prefixes)]
    assert stray == []


@pytest.mark.unit
def test_a_broken_config_is_refused_before_torch_is_imported(tmp_path):
    """`relayrl train broken.yaml`: one line and exit 2, before the jobs (torch, every layer) are imported."""
    bad = tmp_path / "broken.yaml"
    bad.write_text("trainer: {lr: -1}\nrollout: {group_size: 8}\n")
    loaded, printed = _loaded_after(f"from relayrl.cli.main import main; print(main(['train', {str(bad)!r}]))")
    assert printed == "2"
    assert "torch" not in loaded and "relayrl.jobs.train" not in loaded


@pytest.mark.unit  # a fresh interpreter imports the training job: torch and every layer (a few seconds)
def test_the_trainer_does_not_import_the_endpoint_or_its_web_stack():
    """relayrl.serve (starlette, uvicorn; the `serve` extra) is imported only by `relayrl serve`: a training run
    needs none of it installed."""
    code = ("import relayrl.jobs.train, relayrl.cli.main, sys; "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'fastapi') if m in sys.modules))")
    loaded, printed = _loaded_after(code)
    assert printed == "[]"
    assert not [m for m in loaded if m.startswith("relayrl.serve")]
