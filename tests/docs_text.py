"""What the documentation shows a user, read out of README.md and docs/*.md for the tests that
check it against the real command line and config (tests/unit/test_docs_commands.py,
test_docs_keys.py, test_docs_experiments.py)."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""Every page a user reads: the front door and the docs site's pages."""

EXAMPLE_FILES = {p.name: p for p in sorted((ROOT / "examples").glob("*/*.toml"))}
"""Experiment files the pages run by name (`trainflow run charlm.toml` in its folder)."""

SECTIONS = ("preprocess", "train", "evaluate", "cluster", "tracking")
"""The config's sections: a dotted key starting with one of these is a config key."""


@dataclass(frozen=True)
class Fence:
    """A fenced block of a page: its info string (language or MyST directive) and its lines."""

    page: Path
    line: int
    """The line (1-based) of the opening fence."""
    info: str
    body: str
    last: int
    """The line (1-based) of the closing fence."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")


def fences(page: Path) -> list[Fence]:
    """The page's fenced blocks, nested ones (a block inside a list item) included."""
    lines = page.read_text().splitlines()
    out: list[Fence] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        mark, info = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(mark):
            end += 1
        indent = len(lines[i]) - len(lines[i].lstrip())
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        out.append(Fence(page, i + 1, info.strip(), body, end + 1))
        i = end + 1
    return out


def prose(page: Path) -> str:
    """The page without its fenced blocks (their lines blanked, so line numbers hold)."""
    lines = page.read_text().splitlines()
    for fence in fences(page):
        for n in range(fence.line - 1, min(fence.last, len(lines))):
            lines[n] = ""
    return "\n".join(lines)


@dataclass(frozen=True)
class Command:
    """A command line of a page's shell block, as a user would type it."""

    where: str
    text: str
    argv: list[str]
    """The arguments after the program (the shell's quoting undone, comments dropped)."""


_SHELL = {"bash", "sh", "shell", "console", "zsh"}
_SHELL_OPERATORS = {">", ">>", "|", "&&", "||", ";", "&", "2>&1"}


def commands(program: str = "trainflow") -> list[Command]:
    """Every `<program> ...` line of every shell block of every page (continuation lines
    joined; a leading `VAR=value`, `$ ` or a path to the command dropped)."""
    out = []
    for page in PAGES:
        for fence in fences(page):
            if fence.info not in _SHELL:
                continue
            for text in fence.body.replace("\\\n", " ").splitlines():
                words = shlex.split(text, comments=True)
                while words and (words[0] == "$" or re.match(r"^[A-Z_]+=", words[0])):
                    words = words[1:]
                ends = [i for i, w in enumerate(words) if w in _SHELL_OPERATORS]
                words = words[: ends[0]] if ends else words  # `> file`, `| tee`, `&& ...`
                if words and (words[0] == program or words[0].endswith(f"/{program}")):
                    out.append(Command(fence.where, text.strip(), words[1:]))
    return out


@dataclass(frozen=True)
class Setting:
    """A config key a page names in inline code (`train.epochs`), with the value it gives
    (`train.epochs=3`, `--set train.epochs=3`, `train.epochs = 3`) if any."""

    where: str
    key: str
    value: str | None
    """The value as written (None where the page names the key alone)."""
    toml: bool
    """Written as TOML (`key = value`) rather than as a --set (`key=value`)."""


_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_SETTING = re.compile(
    rf"(?:^|[\s'\"(])((?:{'|'.join(SECTIONS)})\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]"
    r"|workdir|name)(?:(\s*=\s*|=)(.+))?$"
)


def settings() -> list[Setting]:
    """Every config key named in inline code outside fenced blocks, on every page. A span is
    one setting (`--set train.lr=0.01`, `train.epochs = 3`, `train.precision`); of a span that
    holds more (a message quoted whole) the key it starts with is checked, without a value."""
    out = []
    for page in PAGES:
        for number, line in enumerate(prose(page).splitlines(), start=1):
            for span in _CODE.findall(line):
                text = span.strip().removeprefix("--set ").strip("'")
                found = _SETTING.match(" " + text)
                if not found or found.start(1) > 1:
                    continue
                key, sign, value = found.groups()
                if key in ("workdir", "name") and sign is None:
                    continue  # the words, not necessarily the keys
                where = f"{page.relative_to(ROOT)}:{number}"
                toml = sign is not None and " " in sign
                if value is not None and not toml and re.search(r"\s", value):
                    value = None  # a message quoted whole: its first key is checked alone
                out.append(Setting(where, key, value, toml))
    return out
