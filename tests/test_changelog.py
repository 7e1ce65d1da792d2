"""CHANGELOG.md is release notes in the Keep a Changelog form, not a lab notebook: small,
an Unreleased section and a versioned one, and no commit hashes (history lives in git)."""
import re
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"
MAX_BYTES = 20_000
# 7 to 12 hex digits with at least one letter and one digit: an abbreviated commit hash
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")


def text() -> str:
    return CHANGELOG.read_text(encoding="utf-8")


def test_the_changelog_is_at_most_20_kb():
    size = CHANGELOG.stat().st_size
    assert size <= MAX_BYTES, f"CHANGELOG.md is {size:,} bytes; release notes stay under {MAX_BYTES:,}"


def test_the_changelog_has_the_keep_a_changelog_sections():
    t = text()
    assert t.startswith("# Changelog"), "CHANGELOG.md must start with '# Changelog'"
    assert re.search(r"^## \[Unreleased\]", t, re.M), "no '## [Unreleased]' section"
    assert re.search(r"^## \[\d+\.\d+\.\d+\]", t, re.M), "no '## [x.y.z]' version section"


def test_the_changelog_names_no_commit():
    found = sorted(set(HASH.findall(text())))
    assert not found, f"commit-hash-like tokens in CHANGELOG.md: {found}"


def test_the_hash_pattern_catches_a_hash_and_spares_numbers():
    # negative control: the pattern must see an abbreviated hash, and not plain numbers or words
    assert HASH.findall("measured at a2c2603 and 9037cd0")
    assert not HASH.findall("1,164 tok/s at depth 8192, fp16, k8v4, sha256, decade")
