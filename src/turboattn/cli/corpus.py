"""The evaluation text: The Jargon File 4.4.7, from Debian's `dict-jargon` package.

Why this text: real English prose (a lexicon of hacker slang with long
explanatory entries) that no one on this team wrote, in the public domain
("This document (the Jargon File) is in the public domain, to be freely used,
shared, and modified", /usr/share/doc/dict-jargon/copyright), and installable
offline on any Debian-based machine with `apt-get install dict-jargon`.
Upstream: Eric S. Raymond et al., The Jargon File, version 4.4.7, 29 Dec 2003.
"""

from __future__ import annotations

import gzip
import os
import re
from functools import lru_cache
from pathlib import Path

# TURBOATTN_CORPUS points at a copy of the same file (e.g. on a GPU machine without the Debian package).
CORPUS_PATH = Path(os.environ.get("TURBOATTN_CORPUS", "/usr/share/dictd/jargon.dict.dz"))
CORPUS_INFO = {
    "name": "The Jargon File, version 4.4.7 (29 Dec 2003)",
    "package": "Debian dict-jargon 4.4.7 (apt-get install dict-jargon)",
    "path": str(CORPUS_PATH),
    "license": "public domain (see /usr/share/doc/dict-jargon/copyright)",
}


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """The whole lexicon as plain text: entries joined by blank lines, paragraphs reflowed."""
    if not CORPUS_PATH.is_file():
        raise FileNotFoundError(f"{CORPUS_PATH} is missing: apt-get install dict-jargon")
    raw = gzip.decompress(CORPUS_PATH.read_bytes()).decode("utf-8")
    # dictd's database header entries start with "00-database"; the lexicon starts after them.
    start = raw.find("\n(TM)\n")
    body = raw[start + 1:] if start >= 0 else raw
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", body)]
    # Drop the "{cross reference}" braces dictd adds; keep the words.
    text = "\n\n".join(p for p in paragraphs if p)
    return text.replace("{", "").replace("}", "")
