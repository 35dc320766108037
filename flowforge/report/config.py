"""The config and provenance sections of ``report.html``.

The config is shown as what the run changed: every ``section.key`` of ``config.yaml`` whose value differs from the
schema default (:func:`flowforge.config.load_config` with no file), beside the default; the full file is one click
away (``<details>``). Provenance lists the versions of torch, diffusers, transformers and peft first (``not
recorded`` for a run written before they were recorded), then everything else ``provenance.json`` holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from flowforge.config import dump_config, load_config
from flowforge.report.summary import esc, note
from flowforge.runtime.run_dir import CONFIG_FILE, PROVENANCE_FILE

VERSION_KEYS = ("torch", "diffusers", "transformers", "peft")
"""Packages whose versions the provenance table always lists first."""


def _flatten(config: dict) -> dict[str, Any]:
    """``{"section.key": value}``: two levels, the config's own (a dict value such as ``reward.weights`` stays
    whole)."""
    out: dict[str, Any] = {}
    for section, body in config.items():
        if isinstance(body, dict):
            for key, value in body.items():
                out[f"{section}.{key}"] = value
        else:
            out[str(section)] = body
    return out


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):  # as written in a config: [a, b], {digit: 1.0}
        return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return json.dumps(value)


def config_diff(text: str) -> list[tuple[str, str, str]] | None:
    """``[(key, value, default)]`` for every key of the YAML ``text`` whose value differs from the default (default
    ``"—"`` for a key the schema does not know); ``None`` when ``text`` is not a YAML mapping."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    if not isinstance(raw, dict):
        return None
    defaults = _flatten(yaml.safe_load(dump_config(load_config(None))))
    rows = []
    for key, value in _flatten(raw).items():
        if key not in defaults:
            rows.append((key, _show(value), "—"))
        elif value != defaults[key]:
            rows.append((key, _show(value), _show(defaults[key])))
    return rows


def config_section(run_dir: Path) -> str:
    """Changed keys against the defaults, then the full ``config.yaml`` folded."""
    path = run_dir / CONFIG_FILE
    head = '<h2 id="config">Config</h2>'
    if not path.is_file():
        return head + note(f"No {CONFIG_FILE} in this run directory.")
    text = path.read_text(encoding="utf-8", errors="replace")
    rows = config_diff(text)
    if rows is None:
        body = note(f"{CONFIG_FILE} is not a YAML mapping; shown in full below.")
    elif not rows:
        body = note("Every key has its default value.")
    else:
        cells = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td><td>{esc(d)}</td></tr>" for k, v, d in rows)
        body = (f"<p>{len(rows)} key(s) differ from the defaults:</p>"
                f'<table class="diff"><tr><th>key</th><th>this run</th><th>default</th></tr>{cells}</table>')
    full = f"<details><summary>Full resolved config ({CONFIG_FILE})</summary><pre>{esc(text)}</pre></details>"
    return head + body + full


def provenance_section(run_dir: Path) -> str:
    """``provenance.json`` as a table, package versions first."""
    path = run_dir / PROVENANCE_FILE
    head = '<h2 id="provenance">Provenance</h2>'
    if not path.is_file():
        return head + note(f"No {PROVENANCE_FILE} in this run directory.")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return head + note(f"{PROVENANCE_FILE} is not valid JSON; shown verbatim.") + f"<pre>{esc(text)}</pre>"
    if not isinstance(data, dict):
        return head + f"<pre>{esc(json.dumps(data, indent=2))}</pre>"
    ordered = {k: data.get(k, "not recorded") for k in VERSION_KEYS} | data
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v if isinstance(v, str) else json.dumps(v))}</td></tr>"
                   for k, v in ordered.items())
    return head + f'<table class="kv">{body}</table>'
