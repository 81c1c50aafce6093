"""Markdown to the HTML subset QTextBrowser renders, with highlighted code blocks (Qt-free).

Raw HTML in a reply is shown as text, never interpreted: a model's output is untrusted. Code is
highlighted with Pygments (inline styles, since QTextBrowser has no class-based CSS for spans)
when it is installed; otherwise code blocks are plain preformatted text.
"""

from __future__ import annotations

import html
import importlib.util
import re
from functools import lru_cache

import markdown
from markdown.extensions import Extension

HAVE_PYGMENTS = importlib.util.find_spec("pygments") is not None
_FENCE = re.compile(r"^\s{0,3}(```|~~~)", re.MULTILINE)
_HIGHLIGHTED = re.compile(
    r'<div class="codehilite" style="background: (#[0-9a-fA-F]+)"><pre[^>]*>(?:<span></span>)?<code>(.*?)</code></pre></div>',
    re.DOTALL,
)
_PLAIN = re.compile(r"<pre><code[^>]*>(.*?)</code></pre>", re.DOTALL)


class _NoRawHtml(Extension):
    """Drop Python-Markdown's raw-HTML passthrough so `<tags>` render as text."""

    def extendMarkdown(self, md: markdown.Markdown) -> None:
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")


@lru_cache(maxsize=4)
def _converter(code_style: str) -> markdown.Markdown:
    configs = {"codehilite": {"noclasses": True, "pygments_style": code_style, "guess_lang": False,
                              "use_pygments": HAVE_PYGMENTS}}
    return markdown.Markdown(
        extensions=[_NoRawHtml(), "fenced_code", "codehilite", "tables", "sane_lists", "nl2br"],
        extension_configs=configs,
        output_format="html",
    )


def close_open_fence(text: str) -> str:
    """A reply still streaming may be inside a code block: close it so it renders as code now."""
    if len(_FENCE.findall(text)) % 2:
        fence = _FENCE.findall(text)[-1]
        return text + ("\n" if not text.endswith("\n") else "") + fence
    return text


def _code_box(code: str) -> str:
    """One table cell per code block: QTextBrowser paints <pre> line by line, with gaps between."""
    return ('<table width="100%" cellspacing="0" cellpadding="6"><tr><td class="code" style="border: none;">'
            f'<pre style="margin: 0px;">{code.rstrip(chr(10))}</pre></td></tr></table>')


def render_markdown(text: str, code_style: str = "default") -> str:
    md = _converter(code_style)
    md.reset()
    try:
        out = md.convert(close_open_fence(text))
    except Exception:  # a pathological input must not break the chat: show it as text
        return "<pre>" + html.escape(text) + "</pre>"
    # The theme's code background, not the Pygments style's: it must stand out from the message.
    out = _HIGHLIGHTED.sub(lambda m: _code_box(m.group(2)), out)
    return _PLAIN.sub(lambda m: _code_box(m.group(1)), out)


def stylesheet(text_color: str, code_background: str, link_color: str, border_color: str) -> str:
    """The small document stylesheet QTextBrowser applies to rendered replies."""
    return f"""
        body {{ color: {text_color}; }}
        a {{ color: {link_color}; }}
        pre {{ background-color: {code_background}; font-family: monospace; white-space: pre-wrap; margin: 4px 0px; }}
        code {{ font-family: monospace; background-color: {code_background}; }}
        td.code {{ background-color: {code_background}; }}
        table {{ border-collapse: collapse; }}
        th, td {{ border: 1px solid {border_color}; padding: 3px 6px; }}
        blockquote {{ margin-left: 12px; color: {text_color}; }}
        p {{ margin-top: 2px; margin-bottom: 6px; }}
    """
