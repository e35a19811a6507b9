"""Proof that scripts/check_sizes.py catches what it is for (CTest structure.sizes_catch_violations):
in a scratch tree, a file of 601 lines, a function of 81 lines (signature to closing brace) and a
class member function of 81 lines fail, each named with its line; a file of 600 lines, a function
of 80, the same long ones with their stated reasons, and braces inside comments, strings and
lambdas pass. Usage: check_sizes_catches.py SCRIPT WORK"""
import os, subprocess, sys

script, work = sys.argv[1], sys.argv[2]
tree = os.path.join(work, "sizes")
os.makedirs(tree, exist_ok=True)
for f in os.listdir(tree):
    os.remove(os.path.join(tree, f))


def function(name, lines, reason=False):
    """A function of exactly `lines` lines, with braces in a comment, a string and a lambda."""
    body = ["  int x = 0;  // } not a brace", '  const char* s = "}{";', "  auto f = [&] { return x; };"]
    body += ["  x += 1;"] * (lines - 2 - len(body))
    head = ["// Long: a stated reason"] if reason else []
    return head + [f"int {name}() {{"] + body + ["}"]


def write(name, lines):
    with open(os.path.join(tree, name), "w") as f:
        f.write("\n".join(lines) + "\n")


write("file_601.cc", ["// filler"] * 601)
write("file_600.cc", ["// filler"] * 600)
write("file_601_reason.cc", ["// Long file: a stated reason"] + ["// filler"] * 600)
write("fn_81.cc", function("too_long", 81))
write("fn_80.cc", function("just_right", 80))
write("fn_81_reason.cc", function("explained", 81, reason=True))
write("member_81.cc", ["namespace n {", "struct S {"] + ["  " + l for l in function("member", 81)] + ["};", "}  // namespace n"])

run = subprocess.run([sys.executable, script, tree], capture_output=True, text=True)
out = run.stdout + run.stderr
print(out)
expected = [
    "file_601.cc:1: 601 lines, more than 600",
    "fn_81.cc:1: too_long has 81 lines, more than 80",
    "member_81.cc:3: member has 81 lines, more than 80",
]
problems = [f"missing: {e}" for e in expected if e not in out]
if run.returncode != 1:
    problems.append(f"exit status {run.returncode}, expected 1")
if len([l for l in out.splitlines() if l.strip()]) != len(expected):
    problems.append(f"expected exactly {len(expected)} violations")
if problems:
    sys.exit("\n".join(problems))
print("check_sizes.py catches every violation and only those")
