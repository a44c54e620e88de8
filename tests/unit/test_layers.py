"""The layering rules of docs/architecture.md, checked on every run so they stay true.

- The import contracts in pyproject.toml (``[tool.importlinter]``): the client never imports the
  server, the server imports only ``batchfs.wire``, the client's layers import downwards only,
  only the mount adapter imports pyfuse3, and no two sibling modules or packages import each other
  in a cycle. ``lint-imports`` (import-linter) checks them from the source, without importing it.
- The contract naming what the server may not import lists every part of ``batchfs`` but
  ``wire``, so a new client module is covered the day it is added.
- Every module opens with a docstring and stays readable in one sitting.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450  # "about 400": a module longer than this holds two things


def _contracts() -> dict[str, dict]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in cfg["contracts"]}


def _lint_imports() -> Path:
    exe = Path(sys.executable).with_name("lint-imports")
    return exe if exe.exists() else Path(shutil.which("lint-imports") or "lint-imports")


def test_import_contracts_hold():
    r = subprocess.run([str(_lint_imports()), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "KEPT" in r.stdout


def _client_parts() -> set[str]:
    pkg = ROOT / "batchfs"
    parts = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    parts |= {p.parent.name for p in pkg.glob("*/__init__.py")}
    return {f"batchfs.{n}" for n in parts}


def test_server_contract_names_every_client_part_but_wire():
    contract = _contracts()["the server imports only batchfs.wire from the client"]
    assert set(contract["forbidden_modules"]) == _client_parts() - {"batchfs.wire"}


def test_wire_contract_names_every_other_client_part():
    contract = _contracts()["wire is protocol only: it imports nothing else of batchfs"]
    assert _client_parts() - {"batchfs.wire"} <= set(contract["forbidden_modules"])


def _modules():
    for top in ("batchfs", "server"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_every_module_opens_with_its_purpose():
    missing = [str(p.relative_to(ROOT)) for p in _modules()
               if p.stat().st_size and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without an opening docstring: {missing}"


def test_modules_stay_readable_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split along a real seam): {long}"
