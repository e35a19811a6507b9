#!/usr/bin/python3
"""Checks that the README's C++ code is the examples' code.

A fenced code block is tied to an example file by the paragraph just before it, which names
the file (e.g. "[examples/cpp/dispatcher.cc](examples/cpp/dispatcher.cc):"). The block must equal
the file, or, when that paragraph says "excerpt", be a run of consecutive lines of the file, exactly
but for a common indentation removed.
Every ```cpp block must name a file, and every examples/cpp/*.cc file must be quoted at least
once, so the README shows only code that is built and run by the test suite.

    check_readme_examples.py README.md SOURCE_DIR
"""

import pathlib
import re
import sys
import textwrap


def blocks(text):
    """(fence info, block lines, the paragraph before the fence, line number) per block."""
    lines = text.split("\n")
    i, paragraph, last = 0, "", ""
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            if lines[i].strip():
                paragraph = paragraph + " " + lines[i]
            elif paragraph:
                last, paragraph = paragraph, ""
            i += 1
            continue
        previous = paragraph or last
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise SystemExit(f"README line {start + 1}: unterminated code block")
        yield m.group(1), body, previous, start + 1
        paragraph = last = ""
        i += 1


def main():
    readme, source = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    errors, quoted = [], set()
    for info, body, previous, line in blocks(readme.read_text()):
        names = sorted(set(re.findall(r"examples/[\w./-]+\.(?:cc|cpp|hpp|py)", previous)))
        if not names:
            if info == "cpp":
                errors.append(f"line {line}: a C++ block that names no example file")
            continue
        if len(names) > 1:
            errors.append(f"line {line}: the block names several files: {', '.join(names)}")
            continue
        path = source / names[0]
        if not path.is_file():
            errors.append(f"line {line}: {names[0]} does not exist")
            continue
        quoted.add(names[0])
        file_lines = path.read_text().rstrip("\n").split("\n")
        if "excerpt" in previous.lower():
            n, excerpt = len(body), textwrap.dedent("\n".join(body))
            if n == 0 or not any(textwrap.dedent("\n".join(file_lines[k:k + n])) == excerpt
                                 for k in range(len(file_lines) - n + 1)):
                errors.append(f"line {line}: the excerpt is not a run of lines of {names[0]}")
        elif body != file_lines:
            diff = next((k for k in range(min(len(body), len(file_lines))) if body[k] != file_lines[k]),
                        min(len(body), len(file_lines)))
            errors.append(f"line {line}: the block differs from {names[0]} at its line {diff + 1}")
    for path in sorted((source / "examples" / "cpp").glob("*.cc")):
        name = path.relative_to(source).as_posix()
        if name not in quoted:
            errors.append(f"{name} is quoted by no README block")
    for e in errors:
        print(f"{readme}: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"{readme}: {len(quoted)} example files quoted, all match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
