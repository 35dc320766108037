"""Where the pipeline's processes meet: rank 0's decisions shared with every rank (:func:`on_main`), and the judge
endpoints of one invocation (:class:`Endpoints`: the teacher, and the student's server)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import yaml

from flowforge.orchestrate.config import judge_options
from flowforge.orchestrate.directory import PipelineLayout
from flowforge.orchestrate.servers import TOKEN_ENV, JudgeServer, pipeline_token
from flowforge.runtime.distributed import broadcast_from_main
from flowforge.runtime.durable import write_bytes

log = logging.getLogger("flowforge")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    """Whether this process is rank 0 (or the only process)."""
    import torch.distributed as dist

    return not _distributed() or dist.get_rank() == 0


def on_main(fn: Any) -> Any:
    """``fn()`` run on rank 0 only and its result broadcast to every rank (``fn()`` itself on one process): file
    reads that steer the collectives, and work with one writer. An exception on rank 0 is raised there and as a
    RuntimeError quoting it on the other ranks, so no rank is left waiting in a collective. A collective."""
    if not _distributed():
        return fn()
    result, error = None, None
    if is_main():
        try:
            result = ("ok", fn())
        except BaseException as exc:
            error, result = exc, ("error", f"{type(exc).__name__}: {exc}")
    kind, value = broadcast_from_main(result)
    if error is not None:
        raise error
    if kind == "error":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


class Endpoints:
    """The judge endpoints of one invocation: the teacher (``teacher.url``, or a server started on first use) and
    the student's server; every started server is stopped by :meth:`close`."""

    def __init__(self, pcfg: Any, layout: PipelineLayout) -> None:
        self.pcfg, self.layout = pcfg, layout
        self.stack = contextlib.ExitStack()
        self._teacher: dict[str, Any] | None = None
        self._students: dict[str, dict[str, Any]] = {}
        self.token_file = pipeline_token(layout.token)

    def teacher(self) -> dict[str, Any]:
        """``reward.options.vlm_judge`` for the teacher (under torchrun a collective: rank 0 starts the server,
        every rank gets its address)."""
        if self._teacher is None:
            t = self.pcfg.teacher
            if t.url:
                self._teacher = judge_options(self.pcfg, base_url=t.url, model=t.model,
                                              api_key_env=t.api_key_env or None)
            else:
                backend = ["--scorer", t.scorer] if t.scorer else ["--model", t.model_dir]
                options = self.layout.server_options("teacher")
                if t.scorer_options:
                    backend += ["--options", str(options)]
                backend += ["--score-range", str(t.score_range[0]), str(t.score_range[1])]

                def start() -> str:
                    if t.scorer_options:  # rewritten at every start: the pipeline's own file, from the config
                        options.parent.mkdir(parents=True, exist_ok=True)
                        write_bytes(options, yaml.safe_dump(dict(t.scorer_options)).encode())
                    return self._start(backend, t.model, "teacher", request_log=True).api_root

                api_root = on_main(start)
                self._teacher = judge_options(self.pcfg, base_url=api_root, model=t.model, api_key_env=TOKEN_ENV)
        return self._teacher

    def student(self, student_dir: Path) -> dict[str, Any]:
        """``reward.options.vlm_judge`` for a ``flowforge serve judge --student`` server of ``student_dir`` (under
        torchrun a collective, as :meth:`teacher`); one server per student directory for the whole invocation
        (stage C and the evaluation of its last good checkpoint share it)."""
        key = str(Path(student_dir).resolve())
        if key not in self._students:
            backend = ["--student", str(student_dir), "--device", self.pcfg.student.device]  # a GPU student on the GPU
            api_root = on_main(lambda: self._start(backend, "student", "student", request_log=True).api_root)
            self._students[key] = {**judge_options(self.pcfg, base_url=api_root, model="student",
                                                   api_key_env=TOKEN_ENV), "paid": False}
        return self._students[key]

    def _start(self, backend: list[str], model: str, name: str, *, request_log: bool) -> JudgeServer:
        log.info("starting the %s judge server (%s)", name, " ".join(backend))
        server = JudgeServer(backend, token_file=self.token_file, model_name=model, num_threads=1,
                             request_log=self.layout.request_log(name) if request_log else None,
                             log_file=self.layout.server_log(name))
        self.stack.callback(server.stop)
        log.info("%s judge at %s", name, server.api_root)
        return server

    def close(self) -> None:
        self.stack.close()
