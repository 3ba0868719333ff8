"""README.md and docs/*.md: the README stays a landing page, and what the pages point at exists.

Checked: the README's length; every relative markdown link resolves to a file or directory; every
`zaya <subcommand>` in code spans and code blocks names a real subcommand of the CLI's parser; every
`python tools/X.py` / `python benchmarks/X.py` names a script that exists; every code span that is a
repository path (`tests/test_loss.py`, `zaya_jax/hardware.py`, `parallel/rules.py`, ...) exists;
and the test command `.ci/run` runs appears, word for word, in a README code block.
"""

import glob
import os
import re

import pytest
from paths import ROOT

README = os.path.join(ROOT, "README.md")
README_MAX_LINES = 200

LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)[^\n]*\n(?P<body>.*?)^\1[ \t]*$", re.DOTALL | re.MULTILINE)
INDENTED = re.compile(r"(?:^(?: {4}|\t)[^\n]*\n?)+", re.MULTILINE)
SPAN = re.compile(r"(?<!`)`(?!`)(?P<body>[^`]+?)`(?!`)")
ZAYA = re.compile(r"(?<![\w/.-])zaya\s+(?P<word>[A-Za-z][\w-]*)")
SCRIPT = re.compile(r"\bpython3?\s+(?P<path>(?:tools|benchmarks)/[\w./-]+\.py)\b")
# Top-level folders of the repository, and zaya_jax's subpackages that the pages name without the
# `zaya_jax/` prefix (`parallel/rules.py`).
REPO_DIRS = ("zaya_jax/", "tests/", "tools/", "benchmarks/", "experiments/", "docs/", ".ci/")
PACKAGE_DIRS = ("model/", "parallel/", "train/", "kernels/", "data/", "explore/", "cluster/",
                "checkpoint/", "bench/", "experiment/")
PLACEHOLDER = re.compile(r"[<>{}\s]|\.\.\.")


def _pages() -> list[str]:
    return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _code(text: str) -> list[str]:
    """The code in a markdown text: fenced blocks, indented blocks, and inline spans outside them."""
    blocks = [m.group("body") for m in FENCE.finditer(text)]
    rest = FENCE.sub("\n", text)
    blocks += [m.group(0) for m in INDENTED.finditer(rest)]
    rest = INDENTED.sub("\n", rest)
    return blocks + [m.group("body") for m in SPAN.finditer(rest)]


def _prose(text: str) -> str:
    """The text with fenced blocks removed (links inside code are not links)."""
    return FENCE.sub("\n", text)


def _links(text: str) -> list[str]:
    return [m.group("target") for m in LINK.finditer(_prose(text))]


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith(("#", "//"))


def _subcommands() -> set[str]:
    from zaya_jax.cli import build_parser

    parser = build_parser()
    actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert actions, "zaya_jax.cli.build_parser() has no subcommands"
    return set(actions[0].choices)


def _span_paths(text: str) -> list[str]:
    """Inline code spans that are one repository path, e.g. `tests/test_loss.py`."""
    paths = []
    for m in SPAN.finditer(_prose(text)):
        body = m.group("body").strip()
        if PLACEHOLDER.search(body) or not re.fullmatch(r"[\w./*-]+", body):
            continue
        if body.startswith(REPO_DIRS):
            paths.append(body)
        elif body.startswith(PACKAGE_DIRS) and body.endswith(".py"):
            paths.append("zaya_jax/" + body)
    return paths


def _exists(repo_path: str) -> bool:
    full = os.path.join(ROOT, repo_path)
    return bool(glob.glob(full)) if "*" in repo_path else os.path.exists(full)


# --- the checks, written as functions of a page's text so that the test below can see them fail ---


def bad_links(path: str, text: str) -> list[str]:
    bad = []
    for target in _links(text):
        if not _is_relative(target):
            continue
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not file_part:
            continue
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), file_part))):
            bad.append(target)
    return bad


def bad_commands(text: str, subcommands: set[str]) -> list[str]:
    return sorted({f"zaya {m.group('word')}" for code in _code(text) for m in ZAYA.finditer(code)
                   if m.group("word") not in subcommands})


def bad_scripts(text: str) -> list[str]:
    return sorted({m.group("path") for m in SCRIPT.finditer(text) if not os.path.isfile(os.path.join(ROOT, m.group("path")))})


def bad_paths(text: str) -> list[str]:
    return sorted({p for p in _span_paths(text) if not _exists(p)})


PAGES = _pages()
IDS = [_rel(p) for p in PAGES]


def test_readme_is_a_landing_page():
    lines = _text(README).count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/"


def test_there_are_docs_pages_and_the_readme_links_every_one():
    docs = [p for p in PAGES if p != README]
    assert docs, "no docs/*.md pages found"
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#")[0])) for t in _links(_text(README)) if _is_relative(t)}
    missing = [_rel(p) for p in docs if os.path.normpath(p) not in linked]
    assert not missing, f"README.md does not link these docs pages: {missing}"


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_relative_links_resolve(path):
    bad = bad_links(path, _text(path))
    assert not bad, f"{_rel(path)}: links to files that do not exist: {bad}"


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_zaya_commands_are_real_subcommands(path):
    subcommands = _subcommands()
    bad = bad_commands(_text(path), subcommands)
    assert not bad, f"{_rel(path)}: commands that are not `zaya` subcommands ({sorted(subcommands)}): {bad}"


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_python_scripts_exist(path):
    bad = bad_scripts(_text(path))
    assert not bad, f"{_rel(path)}: `python` runs scripts that do not exist: {bad}"


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_repository_paths_in_code_spans_exist(path):
    bad = bad_paths(_text(path))
    assert not bad, f"{_rel(path)}: code spans name repository paths that do not exist: {bad}"


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs "the test command from README.md": the line after that comment must appear
    in one of the README's code blocks, word for word."""
    lines = _text(os.path.join(ROOT, ".ci", "run")).splitlines()
    marker = [i for i, line in enumerate(lines) if "test command from README.md" in line]
    assert marker, ".ci/run: no '# The test command from README.md:' line"
    command = lines[marker[0] + 1].strip()
    assert command.startswith("python -m pytest"), f".ci/run: the line after the marker is not a pytest command: {command!r}"
    blocks = [m.group("body") for m in FENCE.finditer(_text(README))]
    assert any(command in (line.strip() for line in b.splitlines()) for b in blocks), (
        f"README.md: no code block holds .ci/run's test command {command!r}")


def test_the_checks_catch_what_they_should(tmp_path):
    """Each check fails on a page with a broken link, a made-up subcommand, a missing script or path."""
    page = tmp_path / "page.md"
    text = ("See [ok](https://example.com), [here](#anchor) and [gone](no_such_file.md#part).\n\n"
            "```bash\nzaya frobnicate --x\nzaya train --config=a.py\npython tools/no_such_tool.py\n```\n\n"
            "Run `zaya explode` or read `tests/test_no_such_test.py` and `parallel/no_such.py`.\n")
    page.write_text(text)
    assert bad_links(str(page), text) == ["no_such_file.md#part"]
    assert bad_commands(text, {"train"}) == ["zaya explode", "zaya frobnicate"]
    assert bad_scripts(text) == ["tools/no_such_tool.py"]
    assert bad_paths(text) == ["tests/test_no_such_test.py", "zaya_jax/parallel/no_such.py"]
