"""Issue 43 item 8: ``--device cuda`` on a machine without CUDA is one line, exit 2, before anything loads."""

import socket

import pytest
import torch

from flowforge.cli import main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
MESSAGE = "error: --device: CUDA is not available on this machine; use --device cpu\n"


@pytest.fixture
def busy_port():
    """A port already listening: a server started on it by mistake fails at once instead of serving forever."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


@pytest.mark.parametrize("args", [
    ["sample", "demo:base", "--prompt", "a handwritten seven", "--device", "cuda", "--out", "{tmp}/grid.png"],
    ["serve", "reward", "--scorers", "digit", "--device", "cuda:1", "--port", "{port}", "--token-file", "{tmp}/t"],
    ["serve", "judge", "--scorer", "digit", "--device", "cuda", "--port", "{port}", "--token-file", "{tmp}/t"],
], ids=["sample", "serve-reward", "serve-judge"])
def test_cuda_without_cuda_is_one_line_exit_2(args, tmp_path, busy_port, capsys):
    args = [a.format(tmp=tmp_path, port=busy_port) for a in args]
    assert main(args) == 2
    assert capsys.readouterr().err == MESSAGE
    assert list(tmp_path.iterdir()) == []  # nothing written: no grid, no token file


def test_a_string_that_is_no_device_is_one_line_exit_2(tmp_path, capsys):
    assert main(["sample", "demo:base", "--prompt", "x", "--device", "gpu", "--out", str(tmp_path / "g.png")]) == 2
    assert capsys.readouterr().err == "error: --device: 'gpu' is not a device; give cpu, cuda or cuda:N\n"
