"""The one page style of flowforge's HTML reports: a run's ``report.html`` (:mod:`flowforge.report.run`) and a
pipeline's (:mod:`flowforge.orchestrate.report`) share this stylesheet and skeleton, so both read alike.

A page is a title, a grey subtitle line, a row of in-page links and its sections, in order; every section is HTML
the caller built with :func:`esc`-aped text. The ``verdict`` block (:func:`verdict_block`) is the answer a reader
came for -- a headline line, a few facts, and a figure beside them -- and opens both reports.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1320px; margin: 1.5em auto;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
nav { margin: 0.4em 0 1em; } nav a { margin-right: 1em; } .note { color: #666; font-style: italic; }
.verdict { display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; border: 1px solid #ccd;
           background: #f7f8fc; border-radius: 6px; padding: 0.8em 1em; }
.verdict .facts { flex: 1 1 380px; min-width: 320px; } .verdict .figure { flex: 0 1 auto; }
.verdict .headline { font-size: 1.2em; margin: 0 0 0.4em; }
.verdict ul { margin: 0.3em 0; padding-left: 1.2em; } .verdict li { margin: 0.15em 0; }
.good { color: #1a7f37; font-weight: 600; } .bad { color: #b42318; font-weight: 600; }
.flat { color: #7a5c00; font-weight: 600; }
img.plot { max-width: 100%; display: block; margin: 0.5em 0; }
img.grid, img.compare { image-rendering: pixelated; max-width: 100%; border: 1px solid #ccc; }
.grids { display: flex; flex-wrap: wrap; gap: 1em; } figure { margin: 0; } figcaption { font-size: 0.85em; }
.first-last { display: flex; gap: 1.5em; align-items: flex-start; } .column { flex: 1 1 0; min-width: 0; }
.first-last.stacked { flex-direction: column; }
.cells { display: flex; flex-wrap: wrap; gap: 0.4em; }
.cell { width: 88px; } img.cell { width: 88px; image-rendering: pixelated; border: 1px solid #ccc; display: block; }
.cap { font-size: 0.68em; line-height: 1.15; word-wrap: break-word; }
.cell.video { width: auto; margin-bottom: 0.6em; } .strip { display: flex; flex-wrap: wrap; gap: 3px; }
.frame { text-align: center; }
img.frame { image-rendering: pixelated; border: 1px solid #ccc; display: block; }
.act { font-size: 0.75em; line-height: 1.1; overflow-wrap: anywhere; }
.fhead, .rows { font-size: 0.7em; color: #666; } .arrow { font-weight: 700; font-size: 1.3em; }
img.frame.real { margin-top: 2px; border-color: #9ab; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.summary th, table.kv th { white-space: nowrap; } details { margin: 0.6em 0; } summary { cursor: pointer; }
"""


def esc(value: Any) -> str:
    """``value`` as HTML-escaped text (quotes included)."""
    return html.escape(str(value), quote=True)


def plain_text(fragment: str) -> str:
    """The visible text of an HTML ``fragment`` (tags dropped, entities decoded): for files that programs read."""
    from html.parser import HTMLParser

    parts: list[str] = []
    parser = HTMLParser()  # convert_charrefs: handle_data gets decoded text
    parser.handle_data = parts.append
    parser.feed(fragment)
    parser.close()
    return "".join(parts)


def note(text: str) -> str:
    """A grey italic remark (``text`` is escaped)."""
    return f'<p class="note">{esc(text)}</p>'


def kv_table(rows: Sequence[tuple[str, str]], css_class: str = "kv") -> str:
    """A two-column table; keys are escaped, values are HTML the caller built."""
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="{css_class}">{body}</table>'


def verdict_block(headline: str, facts: Sequence[str], figure: str = "") -> str:
    """The answer first: ``headline`` (HTML) in large type, ``facts`` (HTML each) as a list, ``figure`` (an
    ``<img>``, or "") beside them."""
    items = "".join(f"<li>{f}</li>" for f in facts)
    side = f'<div class="figure">{figure}</div>' if figure else ""
    return (f'<section id="verdict" class="verdict"><div class="facts"><p class="headline">{headline}</p>'
            f"<ul>{items}</ul></div>{side}</section>")


def render_page(title: str, subtitle: str, nav: Sequence[tuple[str, str]], sections: Sequence[str]) -> str:
    """The whole page: ``title`` and ``subtitle`` (plain text, escaped), ``nav`` as ``(anchor id, label)`` links,
    then ``sections`` (HTML) in order."""
    links = "".join(f'<a href="#{esc(anchor)}">{esc(label)}</a>' for anchor, label in nav)
    return "\n".join([
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="note">{esc(subtitle)}</p>',
        f"<nav>{links}</nav>",
        *sections,
        "</body></html>\n",
    ])
