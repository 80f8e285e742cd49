"""MkDocs hook: keep ``--strict`` meaningful under ``--quiet``.

In mkdocs 1.6, ``--quiet`` raises the ``mkdocs`` logger to ERROR, so warnings
are never emitted, strict mode counts none, and a build with broken links or
docstrings passes. With strict mode on, this lowers the level back to WARNING:
``--quiet`` still hides the INFO lines, and every warning is shown and fails
the build.
"""

import logging


def on_config(config):
    if config.strict:
        log = logging.getLogger("mkdocs")
        if log.level > logging.WARNING:
            log.setLevel(logging.WARNING)
    return config
