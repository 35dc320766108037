"""The ``flowforge`` entry point itself."""

import pytest

from flowforge import __version__
from flowforge.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"flowforge {__version__}\n"


@pytest.mark.parametrize("client", ["httpx", "openai"])
def test_http_request_lines_are_not_logged_at_info(caplog, client):
    """After the CLI set up logging, an httpx request (as the reward client makes) and one through the HTTP library
    the openai SDK uses (the judge client's; httpx2 in some releases) log nothing at INFO."""
    import http.server
    import importlib
    import logging
    import threading

    if client == "openai":  # the module openai's client imports as its HTTP library
        import openai._base_client as base_client

        httpx = next(v for k, v in vars(base_client).items() if k in ("httpx", "httpx2") and hasattr(v, "get"))
    else:
        httpx = importlib.import_module("httpx")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["check", "examples/digits/grpo.yaml"]) == 0
        with caplog.at_level(logging.INFO):
            httpx.get(f"http://127.0.0.1:{server.server_address[1]}/README.md").raise_for_status()
    finally:
        server.shutdown()
        server.server_close()
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))], httpx.__name__


@pytest.mark.parametrize("argv, dest, expected", [
    (["check", "c.yaml", "--portable", "train.steps=3"], "paths", ["c.yaml", "train.steps=3"]),
    (["check", "c.yaml", "a=1", "--print", "b=2", "--portable", "c=3"], "paths", ["c.yaml", "a=1", "b=2", "c=3"]),
    (["train", "c.yaml", "--overwrite", "train.steps=3", "--no-progress", "run.seed=1"], "overrides",
     ["train.steps=3", "run.seed=1"]),
    (["sft", "c.yaml", "--no-progress", "sft.steps=2"], "overrides", ["sft.steps=2"]),
    (["stages", "c.yaml", "--stage", "A", "run.name=x"], "overrides", ["run.name=x"]),
    (["compare", "c.yaml", "--no-progress", "train.steps=2", "run.seed=0"], "overrides",
     ["train.steps=2", "run.seed=0"]),
])
def test_overrides_are_accepted_anywhere_after_the_config(argv, dest, expected):
    from flowforge.cli import parse_args

    assert getattr(parse_args(argv), dest) == expected


def test_a_left_over_option_or_a_verb_without_overrides_is_refused(capsys):
    from flowforge.cli import parse_args

    for argv in (["train", "c.yaml", "--overwrite", "--nope"], ["report", "runs/x", "train.steps=1"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_check_takes_overrides_after_its_options(capsys):
    assert main(["check", "examples/digits/grpo.yaml", "--portable", "train.steps=3", "--print"]) == 0
    out = capsys.readouterr().out
    assert "  steps: 3\n" in out and out.rstrip().endswith("OK: examples/digits/grpo.yaml")
