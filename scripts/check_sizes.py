#!/usr/bin/env python3
"""The size rule of the sources (docs/architecture.md): no unit over its limit unless a comment
states why. Prints each violation as path:line and exits 1 if any.

Limits:
  C++ and CUDA (.cc .cpp .h .hh .hpp .cu .cuh)  files up to 600 lines, functions up to 80 lines
                                               (from the signature to the closing brace)
  Python (.py)                                 files up to 500 lines, functions up to 60 lines
                                               (from the `def` line to the function's last line)
The Python limits are lower because a Python line carries what a C++ line does without C++'s
closing-brace lines and declarations: they weigh most in a function (60 lines of Python are about
80 of C++), less in a file, where statements and comments dominate in both (500 against 600).

A reason is stated with `// Long file: <reason>` (Python: `# Long file: <reason>`) among a file's
first 40 lines, and `// Long: <reason>` (`# Long: <reason>`) on one of the 3 lines above a
function's signature (Python: above its `def` or its first decorator).

C++ and CUDA are scanned lexically: comments, string literals and preprocessor lines are blanked,
and of a preprocessor conditional whose branches do not each balance their braces only the first
branch is kept (device and host branches may open a brace each); attributes such as alignas(16),
__launch_bounds__(256) or __attribute__((x)) are ignored; braces are matched, and a brace at namespace or class level that follows a parameter
list opens a function (lambdas and blocks inside a function count towards it). Python is parsed
with the ast module: every function outside another function (module functions and methods) is
measured; functions, classes and lambdas inside one count towards it.

Usage: check_sizes.py [--max-file N] [--max-function N] [--max-py-file N] [--max-py-function N] PATH...
A PATH is a file or a folder, scanned recursively (hidden folders and __pycache__ skipped).
"""
import ast
import pathlib
import re
import sys

CPP_SUFFIXES = ('.cc', '.cpp', '.h', '.hh', '.hpp', '.cu', '.cuh')
ATTRIBUTE = re.compile(r'\b(?:alignas|__align__|__launch_bounds__|__attribute__|__declspec)\s*\(|\[\[')


def blank(text):
    return re.sub(r'[^\n]', ' ', text)


def strip_comments_and_strings(text):
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i); j = n if j < 0 else j; out.append(' ' * (j - i)); i = j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2); j = n if j < 0 else j + 2
            out.append(blank(text[i:j])); i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:]); end = text.find(')' + m.group(1) + '"', i)
            j = end + len(m.group(1)) + 2; out.append(blank(text[i:j])); i = j
        elif c in '"\'':
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == '\\' else 1
            out.append(c + ' ' * (j - i - 1) + c); i = j + 1
        else:
            out.append(c); i += 1
    return ''.join(out)


def strip_preprocessor(text):
    """Blanks directive lines (with their continuations); of a conditional whose branches do not
    each balance their braces, blanks every branch but the first, so that each brace the compiler
    sees is counted once (a device and a host branch may open one brace each)."""
    out = text.split('\n')
    conditionals, open_ones = [], []  # each: the line numbers of its #if, #elif/#else and #endif
    continued = False  # the previous line ended a directive with a backslash
    for i, line in enumerate(out):
        if not (continued or line.lstrip().startswith('#')):
            continue
        word = '' if continued else re.match(r'\s*#\s*(\w*)', line).group(1)
        if word in ('if', 'ifdef', 'ifndef'):
            open_ones.append([i])
        elif word in ('elif', 'else') and open_ones:
            open_ones[-1].append(i)
        elif word == 'endif' and open_ones:
            conditionals.append(open_ones.pop() + [i])
        continued = line.rstrip().endswith('\\')
        out[i] = blank(line)
    for lines in conditionals:  # inner ones first: each closes before the one around it
        branches = list(zip(lines[:-1], lines[1:]))
        if all(sum(out[j].count('{') - out[j].count('}') for j in range(a + 1, b)) == 0 for a, b in branches):
            continue
        for a, b in branches[1:]:
            for j in range(a + 1, b):
                out[j] = blank(out[j])
    return '\n'.join(out)


def strip_attributes(head):
    """The declaration before a brace without its attributes (their parentheses are no parameter list)."""
    while (m := ATTRIBUTE.search(head)):
        opener, closer = ('[', ']') if m.group(0) == '[[' else ('(', ')')
        depth, j = 0, m.end() - (2 if opener == '[' else 1)
        while j < len(head):
            depth += 1 if head[j] == opener else -1 if head[j] == closer else 0
            if depth == 0:
                break
            j += 1
        head = head[:m.start()] + ' ' * (j + 1 - m.start()) + head[j + 1:]
    return head


def cpp_functions(text):
    """(name, first line, last line) of every function of a C++ or CUDA source."""
    s = strip_preprocessor(strip_comments_and_strings(text))
    stack, start, res = [], 0, []
    line_of = lambda pos: s.count('\n', 0, pos) + 1
    for pos, c in enumerate(s):
        if c in ';{}':
            if c == '{':
                head = strip_attributes(s[start:pos])
                if re.search(r'\b(namespace|class|struct|union|enum)\b[^()]*$', head) or re.search(r'extern\s+"', head):
                    kind = 'scope'
                elif all(k == 'scope' for k in stack) and ')' in head and not re.search(r'=\s*$', head.strip()):
                    first = start + len(head) - len(head.lstrip())
                    name = head.strip().split('(')[0].split()[-1] if '(' in head else '?'
                    stack.append(('function', line_of(first), name))
                    start = pos + 1
                    continue
                else:
                    kind = 'block'
                stack.append(kind)
            elif c == '}' and stack:
                top = stack.pop()
                if isinstance(top, tuple):
                    res.append((top[2], top[1], line_of(pos)))
            if not (c == ';' and any(isinstance(k, tuple) for k in stack)):
                start = pos + 1
    return res


def python_functions(text):
    """(name, first line, last line, first decorator line) of every function outside a function."""
    res = []

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                top = min([d.lineno for d in child.decorator_list] + [child.lineno])
                res.append((child.name, child.lineno, child.end_lineno, top))
            else:
                walk(child)

    walk(ast.parse(text))
    return res


def reason_above(lines, first, pattern):
    return any(re.search(pattern, lines[i]) for i in range(max(0, first - 4), first - 1))


def check(path, limits):
    """The violations of one file, as printed lines."""
    python = path.suffix == '.py'
    max_file, max_fn = limits['py-file' if python else 'file'], limits['py-function' if python else 'function']
    mark = '#' if python else '//'
    text = path.read_text()
    lines = text.split('\n')
    n = text.count('\n')
    found = []
    if n > max_file and not any(re.search(mark + r'\s*Long file:\s*\S', l) for l in lines[:40]):
        found.append(f'{path}:1: {n} lines, more than {max_file}, and no "{mark} Long file: <reason>"')
    if python:
        try:
            spans = python_functions(text)
        except SyntaxError as e:
            return found + [f'{path}:{e.lineno}: cannot be parsed: {e.msg}']
    else:
        spans = [(name, a, b, a) for name, a, b in cpp_functions(text)]
    for name, a, b, top in spans:
        reason = mark + r'\s*Long:\s*\S'
        if b - a + 1 > max_fn and not reason_above(lines, a, reason) and not reason_above(lines, top, reason):
            found.append(f'{path}:{a}: {name} has {b - a + 1} lines, more than {max_fn}, and no "{mark} Long: <reason>" '
                         'above it')
    return found


def sources(root):
    root = pathlib.Path(root)
    if root.is_file():
        return [root]
    return [p for p in sorted(root.rglob('*'))
            if p.is_file() and p.suffix in CPP_SUFFIXES + ('.py',)
            and not any(part.startswith('.') or part == '__pycache__' for part in p.relative_to(root).parts[:-1])]


def main():
    args = sys.argv[1:]
    limits = {'file': 600, 'function': 80, 'py-file': 500, 'py-function': 60}
    while args and args[0].startswith('--'):
        opt, value, args = args[0][2:], args[1], args[2:]
        if opt.startswith('max-') and opt[4:] in limits:
            limits[opt[4:]] = int(value)
        else:
            sys.exit(f'check_sizes.py: unknown option --{opt}')
    bad = 0
    for root in args:
        for p in sources(root):
            for line in check(p, limits):
                print(line)
                bad += 1
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
