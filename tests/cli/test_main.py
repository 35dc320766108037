"""The ``flowforge`` entry point itself."""

import pytest

from flowforge import __version__
from flowforge.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"flowforge {__version__}\n"


def test_http_request_lines_are_not_logged_at_info(caplog):
    """After the CLI set up logging, an httpx request (as the judge / reward clients make) logs nothing at INFO."""
    import http.server
    import logging
    import threading

    import httpx

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
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
