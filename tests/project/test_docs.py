"""The README and the documentation pages: every Python example runs as written (on the bundled
model or small shapes), the README stays short and its test command is what CI runs, the site's
home is the README, and every page is in the site's navigation."""

import re

import pytest
from paths import ROOT

PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
BLOCKS = [(p, i, code) for p in PAGES if p.name != "index.md"  # index.md is the README's copy
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


def _name(block) -> str:
    path, i, _ = block
    return f"{path.relative_to(ROOT)}#{i}"


def test_the_docs_have_python_examples():
    assert len(BLOCKS) >= 12


@pytest.mark.parametrize("block", BLOCKS, ids=_name)
def test_python_example_runs(block, capsys):
    path, i, code = block
    exec(compile(code, f"{path.relative_to(ROOT)} python block {i}", "exec"), {"__name__": "docs_example"})


def test_the_readme_is_short_and_its_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert first[0] == 'pip install -e . && specjax generate "def parse_args("'
    assert first[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_site_home_is_the_readme():
    """``docs/index.md`` is the README with its links made relative to ``docs/``."""
    readme = (ROOT / "README.md").read_text().replace("](docs/", "](")
    home = (ROOT / "docs" / "index.md").read_text()
    strip = lambda t: [ln for ln in t.splitlines() if "mkdocs serve" not in ln and "also built as a site" not in ln]  # noqa: E731
    assert strip(home) == strip(readme)


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M))
    assert pages == listed, pages ^ listed
