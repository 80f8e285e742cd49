"""Griffe extension: render the docstrings' Sphinx roles as links.

The library's docstrings are Google style with Sphinx roles
(``:func:`~chunked_entropy.log_probs_and_entropy```), readable in ``help()``
and in editors. Markdown has no roles, so each one becomes an optional
mkdocs-autorefs reference: a link where the target is documented on the site,
plain inline code where it is not (private helpers, torch), never a broken
link.
"""

from __future__ import annotations

import html
import re

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc):`(~?)([\w.]+)`")


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None:
            return

        def link(match: re.Match) -> str:
            short, name = match.group(1) == "~", match.group(2)
            title = html.escape(name.rsplit(".", 1)[-1] if short else name)
            target = name
            if not name.startswith("chunked_entropy"):
                try:
                    target = obj.resolve(name)
                except Exception:  # not a name griffe can resolve from here (e.g. torch)
                    return f"`{title}`"
            return f'<autoref identifier="{html.escape(target)}" optional><code>{title}</code></autoref>'

        obj.docstring.value = _ROLE.sub(link, obj.docstring.value)
