"""The README leads and the feature chapters live in docs/ (issue 32): the README stays short, every
relative link in it and in docs/ reaches a file, and every feature page is reachable from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import support

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_LIMIT = 15_000  # bytes: the bound, so a newcomer reads the README in one sitting
# Pages the README may link without introducing: they describe the code and the config surface, not a feature.
NOT_FEATURES = {"architecture.md", "config-keys.md"}

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional "title" follows).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def relative_links(doc: Path) -> list[str]:
    """The relative link targets of a markdown file, anchors dropped; code blocks and spans are not links."""
    text = INLINE_CODE.sub("", FENCE.sub("", doc.read_text(encoding="utf-8")))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same page
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_under_the_size_limit() -> None:
    size = len(README.read_bytes())
    assert size < README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: move the chapter that grew into its page in docs/ "
        "and leave one paragraph and a link in the README's Features list"
    )


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert not broken, (
        f"{doc.relative_to(ROOT)} links to files that do not exist (relative to {doc.parent.name}/): {broken}"
    )


def test_every_feature_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t).resolve() for t in relative_links(README)}
    pages = [p for p in DOCS if p.name not in NOT_FEATURES]
    assert pages, "docs/ should hold the feature pages"
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages no README link reaches: {missing}; add each to the README's Features list"


def test_config_key_table_lives_only_in_docs() -> None:
    # One copy: docs/config-keys.md, checked against engine/config/support.py by test_config_support.
    readme = README.read_text(encoding="utf-8")
    assert support.BEGIN not in readme and support.support_table_markdown() not in readme, (
        "README.md holds a copy of the config-key table; link docs/config-keys.md instead"
    )
