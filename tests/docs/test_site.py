"""The documentation site builds strictly, and writes every page its nav lists.

`mkdocs build --strict` fails on a link to a page or an anchor that does not exist, and on a page left out of the
nav (mkdocs.yml's `validation`). The configuration and command-line references are generated from the code while
the site builds (docs/hooks/relayrl_docs.py), so a config class or a command that moved or lost its meaning
shows up here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _nav_pages(nav) -> list[str]:
    """The markdown files of an mkdocs nav: nested lists of {title: page or [sub-nav]} and bare pages."""
    pages = []
    for item in nav:
        entries = item.values() if isinstance(item, dict) else [item]
        for entry in entries:
            pages += [entry] if isinstance(entry, str) else _nav_pages(entry)
    return pages


def _html(page: str) -> Path:
    """Where mkdocs writes a page with directory URLs: a/b.md -> a/b/index.html, a/index.md -> a/index.html."""
    p = Path(page)
    return p.with_suffix(".html") if p.stem == "index" else p.with_suffix("") / "index.html"


def test_the_docs_build_strictly_and_write_every_page(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (make setup installs it)")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # material's banner about mkdocs 2 says nothing about this build
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"

    pages = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert len(pages) > 10
    missing = [p for p in pages if not (site / _html(p)).is_file()]
    assert not missing, f"pages in the nav that the build did not write: {missing}"

    generated = {"reference/configuration.md": ["trainer.lr", "rollout.mode", "sft.steps"],
                 "reference/cli.md": ["relayrl train", "--resume", "relayrl plan"],
                 "benchmarks/index.md": ["bench_grpo_trl.py"]}
    for page, words in generated.items():
        html = (site / _html(page)).read_text()
        assert "<!-- relayrl:" not in html, f"{page}: a marker the hook did not expand"
        assert all(w in html for w in words), f"{page} lacks what the build generates: {words}"
