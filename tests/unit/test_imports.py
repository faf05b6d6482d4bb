"""The package's import rules (pyproject.toml's [tool.importlinter]): layers import only
downwards, and core imports no torch."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    run = subprocess.run(
        [sys.executable, "-c", command],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def test_the_cli_module_imports_no_torch():
    """`octavo serve` starts the engine process before the server imports the engine, and
    `--help` answers at once: the CLI's own module must not pull in torch."""
    command = "import sys, octavo.entrypoints.cli; sys.exit('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", command], cwd=ROOT, timeout=120, check=False)
    assert run.returncode == 0, "importing octavo.entrypoints.cli imported torch"
