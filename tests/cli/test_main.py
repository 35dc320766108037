"""The ``flowforge`` entry point itself."""

import pytest

from flowforge import __version__
from flowforge.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"flowforge {__version__}\n"
