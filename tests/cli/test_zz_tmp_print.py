import pytest
from tests.cli.test_errors import CASES, run_cli, places  # noqa

@pytest.mark.parametrize(("args", "must_mention"), CASES)
def test_print(places, args, must_mention):
    args = [a.format(**places) for a in args]
    rc, _, stderr = run_cli(args, places["cwd"])
    print(f"\n[{rc}] {' '.join(args[:2])}\n    {stderr.strip()}")
