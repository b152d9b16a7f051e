"""The `pagedserve` command itself: --version, defaults shown in a subcommand's --help."""

from __future__ import annotations

import pytest

from clients.cli import main as cli


def test_version_and_help_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("pagedserve ")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "(default: localhost:50051)" in " ".join(capsys.readouterr().out.split())
