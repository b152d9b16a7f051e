"""The typed seams stay typed: mypy over the packages [tool.mypy] lists in pyproject.toml (the whole
scheduler, the executor's worker and server, the client library) finds nothing."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mypy_finds_nothing_in_the_typed_packages():
    mypy = shutil.which("mypy") or str(pathlib.Path(sys.executable).with_name("mypy"))
    if not pathlib.Path(mypy).exists():
        pytest.skip("mypy is not installed (it comes with the dev extra)")
    out = subprocess.run([mypy, "--no-incremental"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
