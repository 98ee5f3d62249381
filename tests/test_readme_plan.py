"""The plan reference in the README shows every plan field with the default moec resolves."""

import re
from pathlib import Path

import yaml

from moec.plan import Plan

ROOT = Path(__file__).parents[1]


def readme_plan_block() -> dict:
    """The first YAML block of the README's "## Plans" section, parsed."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Plans\n") :]
    block = re.search(r"```yaml\n(.*?)```", section, flags=re.S)
    assert block is not None, "no yaml block under ## Plans"
    return yaml.safe_load(block.group(1))


def test_the_readme_plan_reference_shows_the_resolved_defaults():
    shown, resolved = readme_plan_block(), Plan().to_dict()
    assert shown == resolved
    assert Plan.from_dict(shown).to_dict() == resolved
