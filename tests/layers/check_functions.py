#!/usr/bin/env python3
"""Checks that no function of lib/ or cuda/ is longer than a limit (default
120 lines, from the line its declaration starts on to its closing brace),
other than those tests/layers/long_functions.txt names (straight-line
validators, one "file:function" per line, each with its reason).

Usage: check_functions.py SOURCE_ROOT [--limit N]
       check_functions.py --self-test SOURCE_ROOT

Comments and string literals are blanked first; a function is a top-level
brace block (inside namespace or extern "C" blocks) whose head (the lines before its "{" back to the previous ";",
"}" or blank line) has a "(" and is not a struct, enum, union, typedef or
initializer. Each long function is printed as
  file:line: name: N lines (limit L)
and the exit status is 1; 0 when there is none. --self-test checks a
planted 121-line function is reported and a 120-line one is not.
"""
import os
import re
import sys

EXT = ('.c', '.h', '.cu', '.cuh')


def blank(text):
    text = re.sub(r'/\*.*?\*/', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text, flags=re.S)
    text = re.sub(r'//[^\n]*', '', text)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"'(\\.|[^'\\\n])*'", "''", text)


def functions(text):
    """(name, first line, lines) of every top-level function of a source
    (namespace and extern "C" blocks are looked through)."""
    lines = blank(text).split('\n')
    out, depth, start, wraps = [], 0, None, []
    for i, line in enumerate(lines):
        for j, ch in enumerate(line):
            if ch == '{':
                if depth == 0 and re.search(r'(\bnamespace\b[\w\s]*|\bextern\s*""\s*)$', line[:j]):
                    wraps.append(True)  # a wrapper, not a block
                    continue
                if depth == 0:
                    start = i
                depth += 1
            elif ch == '}':
                if depth == 0:
                    if wraps:
                        wraps.pop()
                    continue
                depth -= 1
                if depth == 0 and start is not None:
                    h = start
                    while h > 0 and lines[h - 1].strip() and not lines[h - 1].rstrip().endswith((';', '}', '{')):
                        h -= 1
                    head = ' '.join(x.strip() for x in lines[h:start + 1])
                    pre = head.split('(')[0]
                    if '(' in head and '=' not in pre and not re.match(r'(extern|struct|enum|union|typedef)\b', head):
                        names = [x for x in re.findall(r'(\w+)\s*\(', head) if not x.startswith('__')]
                        out.append((names[0] if names else '?', h + 1, i - h + 1))
                    start = None
    return out


def check(root, limit, allowed):
    bad = []
    for top in ('lib', 'cuda'):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(EXT):
                    continue
                p = os.path.join(d, f)
                rel = os.path.relpath(p, root)
                with open(p, encoding='utf-8') as fh:
                    for name, line, n in functions(fh.read()):
                        if n > limit and '%s:%s' % (rel, name) not in allowed:
                            bad.append('%s:%d: %s: %d lines (limit %d)' % (rel, line, name, n, limit))
    return bad


def allowlist(root):
    p = os.path.join(root, 'tests', 'layers', 'long_functions.txt')
    if not os.path.exists(p):
        return set()
    with open(p, encoding='utf-8') as fh:
        return {ln.split()[0] for ln in fh if ln.strip() and not ln.startswith('#')}


def self_test():
    body = lambda n: 'int f%d(int x) {\n' % n + '  x++;\n' * (n - 2) + '}\n'  # noqa: E731
    src = '/* c { */\n' + body(121) + '\nnamespace {\n' + body(120) + '}\nextern "C" {\n' + body(122) + '}\n'
    got = [(name, n) for name, _, n in functions(src)]
    ok = got == [('f121', 121), ('f120', 120), ('f122', 122)]
    print('self-test: %s (%s)' % ('PASS' if ok else 'FAIL', got))
    return 0 if ok else 1


def main(argv):
    if argv[:1] == ['--self-test']:
        return self_test()
    root = argv[0]
    limit = int(argv[argv.index('--limit') + 1]) if '--limit' in argv else 120
    bad = check(root, limit, allowlist(root))
    for b in bad:
        print(b)
    print('%d function(s) over %d lines' % (len(bad), limit))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
