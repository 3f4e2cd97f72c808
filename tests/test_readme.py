"""README's figures are the committed studies' own output: each block README marks as a file's
(`<!-- headline: PATH -->` ... `<!-- /headline -->`) is that file, byte for byte, so a study rerun without README
regenerated (or README edited by hand) fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- headline: (?P<path>\S+) -->\n(?P<text>.*?)\n<!-- /headline -->", re.S)


def test_readme_prints_each_marked_study_file_as_it_is():
    blocks = list(BLOCK.finditer((ROOT / "README.md").read_text()))
    assert blocks, "README marks no study output (<!-- headline: PATH -->)"
    for block in blocks:
        committed = (ROOT / block["path"]).read_text().rstrip("\n")
        assert block["text"] == committed, f"README's block differs from {block['path']}; paste the file in again"
