"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

The docstrings use Sphinx roles (``:class:`X```, ``:func:`f```, ``:meth:`...```); MkDocs renders
them as the role's name followed by code. :func:`on_page_content` drops the role names, leaving
the code, so ``:class:`SemaphoreQueue``` reads as ``SemaphoreQueue``.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|ref):(?=<code)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """The page's HTML without Sphinx role names in front of code spans."""
    return ROLE.sub("", html)
