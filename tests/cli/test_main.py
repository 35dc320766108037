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
