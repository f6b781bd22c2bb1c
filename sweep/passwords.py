"""Passwords in store URLs: hidden in everything printed, logged or written into a table.

A database URL (``postgresql+psycopg://user:secret@host/db``) or a tracking URI may carry a
password or a token; :func:`hide_password` replaces it by ``***`` wherever such a URL can reach
the user (error lines, table headers, manifests, worker command lines). The URL itself travels
through the environment (``sweep.store_urls.STORAGE_ENV``), never a command line ``ps`` shows.
"""

from __future__ import annotations

import re

_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^\s@/]+(?=@)")
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:password|passwd|pwd|token|access_token|secret|api_key|apikey)=)[^&\s'\"]+", re.I
)


def hide_password(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``
    (``postgresql+psycopg://user:***@host/db``, ``...?password=***``, ``...?token=***``): what may
    be printed, written into a table or logged."""
    return _QUERY_SECRET.sub(r"\g<head>***", _PASSWORD.sub(r"\g<head>***", text))
