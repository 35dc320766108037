"""The judge servers the pipeline starts (flowforge.orchestrate.servers) import the installed flowforge, whatever
the working directory holds (issue 24: a flowforge/ directory left there by an export shadowed the package)."""

import os

import httpx

from flowforge.orchestrate.servers import JudgeServer


def test_a_flowforge_directory_in_the_working_directory_does_not_shadow_the_package(tmp_path, monkeypatch):
    shadow = tmp_path / "work" / "flowforge"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing flowforge/ was imported')\n")
    monkeypatch.chdir(tmp_path / "work")
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    with JudgeServer(["--scorer", "digit"], token_file=token, model_name="digit", num_threads=1,
                     log_file=tmp_path / "judge.log", timeout_s=120) as server:
        assert httpx.get(f"{server.url}/health").json()["model"] == "digit"
        # a terminal's Ctrl-C goes to the foreground process group: the judge is outside it, so it keeps serving
        # while the interrupted pipeline finishes its step (was: in the pipeline's group, killed with the step)
        assert os.getpgid(server.proc.pid) != os.getpgrp()
