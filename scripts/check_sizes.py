#!/usr/bin/env python3
"""The size rule of the sources (docs/architecture.md): no file over 600 lines and no function over
80 lines (from its signature to its closing brace) unless a comment states why. A file states it
with a line `// Long file: <reason>` among its first 40 lines, a function with `// Long: <reason>`
on one of the 3 lines above its signature. Prints each violation as path:line and exits 1 if any.

The scan is lexical: comments and string literals are blanked, braces are matched, and a brace at
namespace or class level that follows a parameter list opens a function (lambdas and blocks inside
a function count towards it). Usage: check_sizes.py [--max-file N] [--max-function N] DIR...
"""
import re, sys, pathlib

def strip(text):
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i); j = n if j < 0 else j; out.append(' ' * (j - i)); i = j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2); j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j])); i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:]); end = text.find(')' + m.group(1) + '"', i)
            j = end + len(m.group(1)) + 2; out.append(re.sub(r'[^\n]', ' ', text[i:j])); i = j
        elif c in '"\'':
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == '\\' else 1
            out.append(c + ' ' * (j - i - 1) + c); i = j + 1
        else:
            out.append(c); i += 1
    return ''.join(out)

def functions(path):
    s = strip(path.read_text())
    stack, start, res = [], 0, []
    line_of = lambda pos: s.count('\n', 0, pos) + 1
    for pos, c in enumerate(s):
        if c in ';{}':
            if c == '{':
                head = s[start:pos]
                if re.search(r'\b(namespace|class|struct|union|enum)\b[^()]*$', head) or re.search(r'extern\s+"', head):
                    kind = 'scope'
                elif all(k == 'scope' for k in stack) and ')' in head and not re.search(r'=\s*$', head.strip()):
                    kind = 'function'
                    first = start + len(head) - len(head.lstrip())
                    stack.append(('function', line_of(first), head.strip().split('(')[0].split()[-1] if '(' in head else '?'))
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

def reason_above(lines, first, pattern):
    return any(re.search(pattern, lines[i]) for i in range(max(0, first - 4), first - 1))


def main():
    args = sys.argv[1:]
    max_file, max_fn = 600, 80
    while args and args[0].startswith('--'):
        opt, value, args = args[0], int(args[1]), args[2:]
        if opt == '--max-file': max_file = value
        elif opt == '--max-function': max_fn = value
        else: sys.exit(f'check_sizes.py: unknown option {opt}')
    bad = 0
    for root in args:
        for p in sorted(pathlib.Path(root).rglob('*')):
            if p.suffix not in ('.cc', '.hh', '.hpp', '.cpp', '.h', '.cu', '.cuh'): continue
            text = p.read_text()
            lines = text.split('\n')
            n = text.count('\n')
            if n > max_file and not any(re.search(r'//\s*Long file:\s*\S', l) for l in lines[:40]):
                print(f'{p}:1: {n} lines, more than {max_file}, and no "// Long file: <reason>"'); bad += 1
            for name, a, b in functions(p):
                if b - a + 1 > max_fn and not reason_above(lines, a, r'//\s*Long:\s*\S'):
                    print(f'{p}:{a}: {name} has {b - a + 1} lines, more than {max_fn}, and no "// Long: <reason>" above it')
                    bad += 1
    sys.exit(1 if bad else 0)

if __name__ == '__main__':
    main()
