"""Griffe extension: render the docstrings' Sphinx roles as mkdocstrings links.

The library's docstrings are Google style with Sphinx roles
(``:func:`~chunked_entropy.log_probs_and_entropy```), readable in ``help()``
and in editors. Markdown has no roles, so this rewrites each role into an
mkdocstrings cross-reference when its target is a public name of the package
(documented on the API page), and into plain inline code otherwise.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc):`(~?)([\w.]+)`")


def _public(path: str) -> bool:
    parts = path.split(".")
    return parts[0] == "chunked_entropy" and not any(p.startswith("_") for p in parts)


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None:
            return

        def link(match: re.Match) -> str:
            short, name = match.group(1) == "~", match.group(2)
            title = name.rsplit(".", 1)[-1] if short else name
            target = name
            if not name.startswith("chunked_entropy"):
                try:
                    target = obj.resolve(name)
                except Exception:
                    target = name
            if _public(target):
                return f"[`{title}`][{target}]"
            return f"`{title}`"

        obj.docstring.value = _ROLE.sub(link, obj.docstring.value)
