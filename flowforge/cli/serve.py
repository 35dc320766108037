"""``flowforge serve SERVER ...``: run one of flowforge's HTTP services until interrupted (Ctrl-C / SIGTERM).

::

    flowforge serve reward --scorers digit,jpeg_compressibility [--options FILE] [--host 127.0.0.1] [--port N]
                           [--token-file F | --no-auth] [--device cpu] [--max-batch N] [--max-body-mb N]
    flowforge serve judge (--scorer NAME | --model PATH | --student PATH) [--host 127.0.0.1] [--port N]
                          [--token-file F | --no-auth] [--request-log FILE] [--options FILE] [--score-range LO HI]
                          [--model-name ID]
    both: [--max-connections N] [--client-timeout S]

Each server prints ``serving <name> at http://HOST:PORT`` when it listens (``--port 0`` picks a free port). Auth
rules (:mod:`flowforge.serve.common`): loopback by default; a bearer token from ``--token-file`` (a file that does not
exist yet is created with a fresh token, mode 0600), or generated and printed on stderr; ``--no-auth`` only on a
loopback host. Slow and idle clients (:mod:`flowforge.serve.listen`): a request's headers must arrive within
``--client-timeout`` seconds, and its body may not pause longer (408); over ``--max-connections`` open connections
the oldest idle one is closed.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from flowforge.cli.common import check_device, finite_float
from flowforge.runtime.errors import UserError

HELP = "run a flowforge HTTP service (reward scorers, judge)"
REWARD_PORT = 8765


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """``--host --port --token-file --no-auth``, shared by every server."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default_port, help=f"port (default {default_port}; 0 = a free one)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="file holding the bearer token; created with a fresh token (mode 0600) when it does "
                        "not exist, never overwritten (default: generate a token and print it on stderr)")
    parser.add_argument("--no-auth", action="store_true", help="no token (refused unless --host is loopback)")
    parser.add_argument("--max-connections", type=int, default=1000, metavar="N",
                        help="open connections at most (default 1000, and at most the open-file limit less 256); a "
                        "connection over it closes the oldest idle one")
    parser.add_argument("--client-timeout", type=finite_float, default=30.0, metavar="S",
                        help="seconds a client may take to send a request's headers, or pause while sending its body "
                        "(default 30; then the connection is closed, or the request answered 408)")


def _connection_limits(args: argparse.Namespace) -> dict:
    """``serve_app``'s keyword arguments from ``--max-connections`` / ``--client-timeout``.

    Raises:
        UserError: a value < 1 connection or <= 0 seconds.
    """
    if args.max_connections < 1:
        raise UserError("--max-connections", f"is {args.max_connections}", "give an integer >= 1")
    if not args.client_timeout > 0:
        raise UserError("--client-timeout", f"is {args.client_timeout}", "give a number of seconds > 0")
    return {"max_connections": args.max_connections, "client_timeout_s": args.client_timeout}


def _add_pixel_budget(parser) -> None:
    parser.add_argument("--max-request-mpixels", type=finite_float, default=32.0, metavar="M",
                        help="decoded megapixels (2^20) per request, all images and frames together, read from the "
                        "image headers before decoding (default 32)")


def _pixel_budget(args: argparse.Namespace) -> int:
    value = args.max_request_mpixels
    if not math.isfinite(value) or value <= 0:
        raise UserError("--max-request-mpixels", f"is {value}", "give a finite number > 0")
    return max(1, int(value * 2**20))


def _add_reward(servers) -> None:
    parser = servers.add_parser("reward", help="reward scorers over HTTP (the 'remote' scorer's server)")
    parser.add_argument("--scorers", required=True,
                        help="comma-separated scorer names (built-ins or pkg.module:Factory)")
    parser.add_argument("--options", type=Path, default=None,
                        help="YAML file: scorer name -> keyword options for its factory")
    parser.add_argument("--device", default="cpu", help="device the media are scored on (cpu, cuda, cuda:N)")
    parser.add_argument("--max-batch", type=int, default=256, help="most media items per request")
    _add_pixel_budget(parser)
    parser.add_argument("--max-body-mb", type=finite_float, default=64.0, help="largest request body, MiB")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = torch's default)")
    add_server_args(parser, REWARD_PORT)


def _run_reward(args: argparse.Namespace) -> int:
    import yaml

    from flowforge.serve.common import resolve_token, serve_app

    check_device(args.device)  # before any model loads or a token file is written
    limits = _connection_limits(args)
    names = [n.strip() for n in args.scorers.split(",") if n.strip()]
    options = yaml.safe_load(args.options.read_text()) if args.options is not None else {}
    if not isinstance(options, dict) or any(not isinstance(v, dict) for v in options.values()):
        raise ValueError(f"--options {args.options}: expected a mapping scorer name -> mapping of options")
    unused = sorted(set(options) - set(names))
    if unused:
        raise ValueError(f"--options names scorers that are not served: {unused} (--scorers: {names})")
    check_token_file(args)
    token = resolve_token(args.token_file, args.no_auth, args.host)  # auth errors before any model loads
    import torch

    from flowforge.rewards.registry import build_scorer
    from flowforge.serve.reward_server import build_app

    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    scorers = {name: build_scorer(name, **options.get(name, {})) for name in names}
    app = build_app(scorers, token, max_batch=args.max_batch, max_bytes=int(args.max_body_mb * 2**20),
                    max_request_pixels=_pixel_budget(args), device=args.device,
                    body_timeout_s=limits["client_timeout_s"])
    serve_app(app, args.host, args.port, "reward", **limits)
    return 0


JUDGE_PORT = 8766


def _add_judge(servers) -> None:
    parser = servers.add_parser("judge", help="an OpenAI-compatible judge: a local VLM or a scorer ('vlm_judge')")
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--scorer", help="a scorer wrapped as a group judge (built-in name or pkg.module:Factory)")
    backend.add_argument("--model", help="a local Hugging Face image-text-to-text model directory")
    backend.add_argument("--student", help="a saved student reward model directory (flowforge.reward_model)")
    parser.add_argument("--options", type=Path, default=None, help="YAML file: keyword options for the scorer")
    parser.add_argument("--score-range", type=finite_float, nargs=2, default=(0.0, 1.0), metavar=("LO", "HI"),
                        help="scorer scores mapped linearly from [LO, HI] to the judge's [0, 100] (default 0 1)")
    parser.add_argument("--model-name", default=None, help="model id served (default: the scorer / directory name)")
    parser.add_argument("--request-log", type=Path, default=None, help="append each received request's key here")
    parser.add_argument("--device", default="cpu", help="device of the model / scorer (cpu, cuda, cuda:N)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="cap on a request's max_tokens (--model)")
    parser.add_argument("--max-images", type=int, default=512, help="most images per request")
    _add_pixel_budget(parser)
    parser.add_argument("--max-body-mb", type=finite_float, default=64.0, help="largest request body, MiB")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = torch's default)")
    add_server_args(parser, JUDGE_PORT)


def _run_judge(args: argparse.Namespace) -> int:
    import yaml

    from flowforge.serve.common import resolve_token, serve_app

    check_device(args.device)  # before any model loads or a token file is written
    limits = _connection_limits(args)
    options = yaml.safe_load(args.options.read_text()) if args.options is not None else {}
    if not isinstance(options, dict):
        raise ValueError(f"--options {args.options}: expected a mapping of keyword options")
    if options and args.scorer is None:
        raise ValueError("--options applies to --scorer only")
    if args.request_log is not None:  # the shared write rule, before anything loads or is written
        check_request_log(args)
    check_token_file(args)
    token = resolve_token(args.token_file, args.no_auth, args.host)  # auth errors before any model loads
    import torch

    from flowforge.serve.judge_server import build_app, build_backend

    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    if args.student is not None:
        from flowforge.serve.judge_backends import student_backend

        backend = student_backend(args.student, device=args.device, model_id=args.model_name)
    else:
        backend = build_backend(scorer=args.scorer, model=args.model, scorer_options=options,
                                score_range=tuple(args.score_range), device=args.device, dtype=args.dtype,
                                max_new_tokens=args.max_new_tokens, model_id=args.model_name)
    app = build_app(backend, token, request_log=args.request_log, max_bytes=int(args.max_body_mb * 2**20),
                    max_images=args.max_images, max_request_pixels=_pixel_budget(args),
                    body_timeout_s=limits["client_timeout_s"])
    serve_app(app, args.host, args.port, "judge", **limits)
    return 0


def check_request_log(args: argparse.Namespace) -> None:
    """``--request-log`` under the shared write rule (:func:`flowforge.runtime.write_guard.check_write_target`):
    resolved (symlinks, ``..``), it may not lie inside a run, a checkpoint or a pipeline directory (unless this
    server was started by the pipeline that holds that directory's lock:
    :func:`~flowforge.runtime.lock.held_by_parent`), or be / lie inside the server's own inputs (``--student`` /
    ``--model`` directory, ``--options``, ``--token-file``); and it must be a regular file or a new name in an
    existing directory, openable for appending (not a directory, not ``/dev/full``:
    :func:`flowforge.serve.judge_server.check_log_path`).

    Raises:
        UserError / ValueError: naming ``--request-log`` and what is wrong with it.
    """
    from flowforge.runtime.write_guard import check_write_target
    from flowforge.serve.judge_server import check_log_path

    inputs = {"--student directory": args.student, "--model directory": args.model, "--options file": args.options}
    protected = {label: path for label, path in inputs.items() if path is not None and Path(path).exists()}
    # the token file even before it exists: resolve_token creates it next
    check_write_target(args.request_log, "--request-log", protected={**protected, "--token-file": args.token_file},
                       own=_parent_pipeline(args.request_log))
    check_log_path(Path(args.request_log))


def _parent_pipeline(path: str | Path) -> Path | None:
    """The pipeline directory holding ``path`` when this server was started by the pipeline that holds its lock
    (:func:`~flowforge.runtime.lock.held_by_parent`): the server may write there. Else None."""
    from flowforge.runtime.lock import held_by_parent
    from flowforge.runtime.write_guard import enclosing

    found = enclosing(path)
    return found[1] if found and found[0] == "pipeline directory" and held_by_parent(found[1]) else None


def check_token_file(args: argparse.Namespace) -> None:
    """A ``--token-file`` that does not exist yet is created by the server: under the shared write rule, as any
    file flowforge writes (not inside a run, a checkpoint or another's pipeline directory). An existing one is
    only read.

    Raises:
        UserError: naming ``--token-file`` and the directory it lies in.
    """
    from flowforge.runtime.write_guard import check_write_target

    if args.token_file is not None and not os.path.lexists(args.token_file):
        check_write_target(args.token_file, "--token-file", own=_parent_pipeline(args.token_file))


SERVERS = {"reward": (_add_reward, _run_reward), "judge": (_add_judge, _run_judge)}
"""Server name -> (add its sub-parser, run it)."""


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("serve", help=HELP)
    servers = parser.add_subparsers(dest="server", required=True, metavar="SERVER")
    for add, _ in SERVERS.values():
        add(servers)
    return parser


def run(args: argparse.Namespace) -> int:
    return SERVERS[args.server][1](args)
