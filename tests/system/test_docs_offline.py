"""The built docs site searched from file:// in headless Chromium, with no server (issue 56, item 10).

The site is built as ``make docs`` builds it (strict), into a temporary folder, and its home page is
opened as a file with ``?q=``, which Material's search reads on load: the results must be listed.
Before the ``offline`` plugin the search never started (an empty result count).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, REPO, browser_dom, chromium_path


@pytest.mark.slow
def test_search_finds_pages_from_a_file_url(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "-q", "-f", str(REPO / "docs" / "mkdocs.yml"), "-d", str(site)],
        capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = {")
    dom = browser_dom(chromium_path(), f"{(site / 'index.html').as_uri()}?q=accountant")
    meta = re.search(r'class="md-search-result__meta">([^<]*)<', dom)
    assert meta and re.fullmatch(r"\d+ matching documents?", meta.group(1).strip()), meta
    links = re.findall(r'<a href="([^"]+)" class="md-search-result__link"', dom)
    assert any("privacy-accounting.html" in link for link in links), links
