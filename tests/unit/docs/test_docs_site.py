"""The docs site works opened as files, with no network (issue 56, item 10).

``make docs`` says to open docs/site/index.html; from file:// a page may neither fetch the search index
nor start a Web Worker from a file URL, so search found nothing. Material's ``offline`` plugin inlines
the index into a script and the iframe-worker shim runs the worker; the shim ships with the site.
tests/system/test_docs_offline.py builds the site and searches it in headless Chromium.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from helpers import REPO

DOCS = REPO / "docs"


def _config() -> dict[str, Any]:
    config = yaml.safe_load((DOCS / "mkdocs.yml").read_text())
    assert isinstance(config, dict)
    return config


def test_the_offline_plugin_is_on() -> None:
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in _config()["plugins"]]
    assert "search" in plugins and "offline" in plugins, plugins


def test_the_worker_shim_ships_with_the_site() -> None:
    """The offline plugin adds the shim from unpkg.com unless a polyfill naming iframe-worker is listed:
    the listed one is a file of the site, not a URL."""
    polyfills: list[str] = (_config().get("extra") or {}).get("polyfills", [])
    shims = [p for p in polyfills if "iframe-worker" in p]
    assert shims, polyfills
    for shim in shims:
        assert "://" not in shim and not shim.startswith("//"), shim
        source = Path(DOCS / "src" / shim).read_text()
        assert "window.Worker=" in source and 'location.protocol==="file:"' in source


def test_the_home_page_and_the_readme_list_every_guide() -> None:
    """The docs home and the README's page list left out the audit, recommender and several-devices
    guides: each guide is linked from both, and is in the site's nav."""
    guides = sorted(p.name for p in (DOCS / "src" / "guides").glob("*.md"))
    home = (DOCS / "src" / "index.md").read_text()
    readme = (REPO / "README.md").read_text().split("\n## Documentation\n")[1].split("\n## ")[0]  # its page list
    nav = str(_config()["nav"])
    missing = {
        "docs home": [g for g in guides if f"(guides/{g})" not in home],
        "README": [g for g in guides if f"(docs/src/guides/{g})" not in readme],
        "nav": [g for g in guides if f"guides/{g}" not in nav],
    }
    assert missing == {"docs home": [], "README": [], "nav": []}
