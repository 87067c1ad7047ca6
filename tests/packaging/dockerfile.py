"""A small Dockerfile parser for the packaging tests: instructions with line continuations joined,
comments dropped, grouped into build stages, ARG defaults resolved in FROM lines."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Instruction", "Stage", "parse_dockerfile", "parse_instructions"]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    value: str  # everything after the keyword, continuations joined
    line: int  # 1-based line where it starts

    def exec_form(self) -> list[str] | None:
        """The JSON array of CMD/ENTRYPOINT/RUN exec form, or None for shell form."""
        text = self.value.strip()
        if not text.startswith("["):
            return None
        parsed = json.loads(text)
        assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed)
        return parsed

    def flags(self) -> dict[str, str]:
        """--name=value flags at the start (COPY --from=build, FROM --platform=...)."""
        return dict(re.findall(r"--([a-z-]+)=(\S+)", self.value.split(" /", 1)[0]))

    def words(self) -> list[str]:
        return shlex.split(self.value)


@dataclass
class Stage:
    base: str  # FROM image, ARG defaults substituted
    name: str | None
    index: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions in order. Full-line comments vanish even inside continuations, as in BuildKit;
    the parser directive line (# syntax=...) is a comment here."""
    instructions: list[Instruction] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        joined = " ".join(part for part in buffer if part)
        buffer = []
        keyword, _, value = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
    if buffer:
        raise ValueError(f"line {start}: instruction ends with a line continuation")
    return instructions


def _substitute(value: str, args: dict[str, str]) -> str:
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return args.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, value)


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages). Raises ValueError on instructions before the first FROM
    other than ARG, as Docker does."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for inst in parse_instructions(path.read_text()):
        if inst.keyword == "FROM":
            words = [w for w in inst.value.split() if not w.startswith("--")]
            base = _substitute(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name, index=len(stages)))
        elif not stages:
            if inst.keyword != "ARG":
                raise ValueError(f"line {inst.line}: {inst.keyword} before the first FROM")
            name, _, default = inst.value.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append(inst)
    return global_args, stages
