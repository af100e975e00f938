"""The docs hold up as a reader follows them: named files exist, named make targets exist, nothing reads as a log.

* Every repository path that docs/*.md and README.md name (``bench/...``, ``prof/...``, ``gear_*/...``,
  ``deploy/...``, ``tests/...`` and the other top-level folders) exists.
* Every ``make X`` they name is a target of the Makefile.
* No doc or code file speaks of issue numbers, work sittings, machine nicknames (M1..), "the final tree",
  "this commit" or "used to" stories: git holds the history.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOP_FOLDERS = tuple(sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))))
# A path starts at a top-level folder (not inside a longer word or path) and runs over path characters.
_PATH = re.compile(r"(?<![\w./$-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w./-]*)")
# `make X` in an inline code span, or a line of a fenced block that starts with it.
_MAKE_INLINE = re.compile(r"`make ([a-z][\w-]*)")
_MAKE_LINE = re.compile(r"^\s*make ([a-z][\w-]*)", re.M)
# A module named by its file name alone (`sampler.py`), or by its dotted name (`gear_client.sharding.owners`).
_FILE_NAME = re.compile(r"(?<![\w/.-])([A-Za-z_]\w*\.py)\b")
_PACKAGES = [name for name in TOP_FOLDERS if (ROOT / name / "__init__.py").exists()]
_MODULE = re.compile(r"(?<![\w/.-])((?:" + "|".join(_PACKAGES) + r")(?:\.\w+)+)(?![\w/])")
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)
_TARGET = re.compile(r"^([A-Za-z][\w.-]*(?: [A-Za-z][\w.-]*)*):(?!=)", re.M)
# What reads as a log. Case matters for the nicknames (M1..M9), not for the rest; numpy's datetime dtypes
# ("M8[ns]") are not nicknames.
LOG_WORDS = [
    re.compile(r"\bissues? #?[0-9]", re.I),
    re.compile(r"\bsittings?\b", re.I),
    re.compile(r"\bM[0-9]\b(?!\[)"),
    re.compile(r"\bused to\b", re.I),
    re.compile(r"\bfinal tree\b", re.I),
    re.compile(r"\bthis commit\b", re.I),
    re.compile(r"\b(?:first|second|third|fourth|fifth) session\b|\bstart-of-session\b", re.I),
]
# Files not yet rewritten, with how many of their lines read as a log: no new such line may creep in,
# and an entry a file no longer needs fails the test (lower or remove it then).
KNOWN_LOG_LINES: dict[str, int] = {}
SKIPPED_DIRS = {".git", "_proto", "__pycache__", ".build", "node_modules"}
CODE_SUFFIXES = {".py", ".md"}  # and the Makefile


def named_paths(text: str) -> set[str]:
    """Repository paths a doc names, without trailing punctuation."""
    return {m.group(1).rstrip(".-") for m in _PATH.finditer(text)}


def named_file_names(text: str) -> set[str]:
    """Python file names a doc names without their folder, outside fenced blocks (whose commands may name the
    reader's own scripts)."""
    return set(_FILE_NAME.findall(_FENCED.sub("", text)))


def module_exists(dotted: str) -> bool:
    """A dotted name is a module or package of the repository, or a name inside one."""
    path = ROOT.joinpath(*dotted.split("."))
    parent = path.parent
    return (path.with_suffix(".py").exists() or (path / "__init__.py").exists()
            or parent.with_suffix(".py").exists() or (parent / "__init__.py").exists())


def named_make_targets(text: str) -> set[str]:
    return set(_MAKE_INLINE.findall(text)) | set(_MAKE_LINE.findall(text))


def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for group in _TARGET.findall((ROOT / "Makefile").read_text()):
        targets.update(group.split())
    return targets


def log_words(text: str) -> list[str]:
    """The lines of ``text`` that read as a log, each as 'line N: ...'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if any(p.search(line) for p in LOG_WORDS):
            found.append(f"line {number}: {line.strip()[:160]}")
    return found


def repo_files() -> list[Path]:
    """Doc and code files of the repository: not virtual environments, git's store or generated protos."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".venv"))
        files += [Path(folder, n) for n in sorted(names) if Path(n).suffix in CODE_SUFFIXES or n == "Makefile"]
    return files


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_a_doc_names_exists(doc: Path):
    missing = sorted(p for p in named_paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_module_a_doc_names_exists(doc: Path):
    """A file named alone is a file somewhere in the repository; a dotted module name resolves to a module."""
    text = doc.read_text()
    names = {p.name for p in repo_files()}
    missing = sorted(n for n in named_file_names(text) if n not in names)
    missing += sorted(m for m in set(_MODULE.findall(text)) if not module_exists(m))
    assert not missing, f"{doc.relative_to(ROOT)} names modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_make_target_a_doc_names_exists(doc: Path):
    unknown = sorted(named_make_targets(doc.read_text()) - makefile_targets())
    assert not unknown, f"{doc.relative_to(ROOT)} names make targets the Makefile lacks: {unknown}"


def test_no_doc_or_code_file_reads_as_a_log():
    hits = {}
    for path in repo_files():
        if path == Path(__file__).resolve():
            continue  # this file names the words it looks for
        name = str(path.relative_to(ROOT))
        found = log_words(path.read_text(errors="replace"))
        known = KNOWN_LOG_LINES.get(name, 0)
        if len(found) > known:
            hits[name] = found
        elif len(found) < known:
            hits[name] = [f"{len(found)} left where KNOWN_LOG_LINES lists {known}: lower or remove its entry"]
    missing = sorted(set(KNOWN_LOG_LINES) - {str(p.relative_to(ROOT)) for p in repo_files()})
    assert not missing, f"KNOWN_LOG_LINES names files that do not exist: {missing}"
    assert not hits, "files that speak of issues, sittings or history:\n" + "\n".join(
        f"{name}: {line}" for name, lines in hits.items() for line in lines)


def design_tree() -> list[str]:
    """The paths docs/DESIGN.md's tree lists: a folder's entries are indented under it, several per line
    separated by commas; the purpose starts after two spaces (a line indented past the names continues one)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = text[text.index("## Layout of the tree"):].split("```")[1]
    folders: list[str] = []
    listed = []
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 33):
            continue
        level = (len(line) - len(line.lstrip())) // 2
        names = re.split(r"\s{2,}", line.strip())[0]
        folders = folders[:level]
        listed += ["".join(folders) + name.strip() for name in names.split(",")]
        if names.endswith("/"):
            folders.append(names)
    return listed


def test_the_design_tree_lists_every_module_once():
    listed = design_tree()
    modules = sorted(str(p.relative_to(ROOT)) for p in repo_files() if p.suffix == ".py"
                     and p.name != "__init__.py" and p.relative_to(ROOT).parts[0].startswith("gear_"))
    assert sorted(set(modules) - set(listed)) == [], "modules on disk that docs/DESIGN.md's tree does not list"
    assert [p for p in listed if not (ROOT / p).exists()] == [], "docs/DESIGN.md's tree lists paths that do not exist"
    assert sorted(p for p in set(listed) if listed.count(p) > 1) == [], "docs/DESIGN.md's tree lists paths twice"


def test_the_checks_find_what_they_look_for():
    """Each check on a text made to fail it (so a broken pattern cannot pass everything)."""
    text = ("see `bench/bench_core.py`, prof/prof_nothing.py and gear_server/table/ (not x/bench/y);\n"
            "run `make bench-gpu` or\n```\nmake no-such-target\n```\n")
    assert named_paths(text) == {"bench/bench_core.py", "prof/prof_nothing.py", "gear_server/table/"}
    assert named_make_targets(text) == {"bench-gpu", "no-such-target"}
    assert named_file_names(text) == set()
    assert named_file_names("see `sampler.py` and owners.py, not gear_client/x.py") == {"sampler.py", "owners.py"}
    assert named_file_names("run\n```sh\npython3 train.py\n```\n") == set()
    assert module_exists("gear_client.sharding.owners") and module_exists("gear_client.client.Client")
    assert not module_exists("gear_client.no_such_module.x")
    assert _MODULE.findall("`gear_client.sharding.owners`, deploy/gear_learner.py, gear_common.cuh") == [
        "gear_client.sharding.owners"]
    assert {"test", "bench-gpu", "install-service"} <= makefile_targets()
    assert "no-such-target" not in makefile_targets()
    for line in ["(issue 11)", "Issue 12.5: x", "issues #3", "the third sitting", "on M4 we", "final tree",
                 "this commit", "it used to stall", "the second session"]:
        assert log_words(line), line
    for line in ['np.dtype("M8[ns]")', "refused token", "a session of the learner",
                 "tissue 3", "m4 rows"]:
        assert not log_words(line), line
