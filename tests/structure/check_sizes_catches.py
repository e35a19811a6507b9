"""Proof that scripts/check_sizes.py catches what it is for (CTest structure.sizes_catch_violations):
in a scratch tree, each over-limit unit fails, named with its line, and nothing else does.

C++: a file of 601 lines, a function of 81 lines (signature to closing brace) and a class member
function of 81 lines fail; a file of 600 lines, a function of 80, the same long ones with their
stated reasons, and braces inside comments, strings and lambdas pass.
CUDA: a .cu file of 601 lines, a __global__ __launch_bounds__ kernel of 81 lines (named as the
kernel) and an 81-line member function of an alignas(16) struct in a .cuh fail; a kernel of 80
lines whose device and host preprocessor branches each open a brace, with a kernel launch, passes.
Python: a file of 501 lines, a function of 61 lines (def to its last line) and an async method of
61 lines fail; a file of 500 lines, a function of 60 holding a nested function, a lambda and a
string with "def" in it, a file and a decorated function of 61 lines with their stated reasons pass.
Usage: check_sizes_catches.py SCRIPT WORK"""
import os
import subprocess
import sys

script, work = sys.argv[1], sys.argv[2]
tree = os.path.join(work, "sizes")
os.makedirs(tree, exist_ok=True)
for f in os.listdir(tree):
    os.remove(os.path.join(tree, f))


def function(name, lines, reason=False):
    """A C++ function of exactly `lines` lines, with braces in a comment, a string and a lambda."""
    body = ["  int x = 0;  // } not a brace", '  const char* s = "}{";', "  auto f = [&] { return x; };"]
    body += ["  x += 1;"] * (lines - 2 - len(body))
    head = ["// Long: a stated reason"] if reason else []
    return head + [f"int {name}() {{"] + body + ["}"]


def kernel(name, lines):
    """A CUDA kernel of exactly `lines` lines: attributes in its signature, a device and a host
    branch that open one brace each, a kernel launch."""
    body = ["#if defined(__CUDA_ARCH__)", "  if (n > 0) {", "#else", "  if (n >= 0) {", "#endif", "    f(n);", "  }",
            "  each_kernel<<<1, 256>>>(n, f);"]
    body += ["  f(n + 1);"] * (lines - 2 - len(body))
    return [f"template <class F> __global__ void __launch_bounds__(256) {name}(int n, F f) {{"] + body + ["}"]


def py_function(name, lines, indent="", head=(), keyword="def"):
    """A Python function of exactly `lines` lines (def to its last line), holding a nested
    function, a lambda and a string with "def" in it."""
    body = ["def inner():", "    return 'def not_a_function(): {'", "square = lambda v: v * v", 'text = """',
            "def inside_a_string():", '"""', "x = 0"]
    body += ["x += 1"] * (lines - 2 - len(body)) + ["return x"]
    return [indent + h for h in head] + [f"{indent}{keyword} {name}():"] + [indent + "    " + b for b in body]


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

write("file_601.cu", ["// filler"] * 601)
write("kernel_81.cu", kernel("too_long_kernel", 81))
write("kernel_80.cu", kernel("just_right_kernel", 80))
write("struct_81.cuh", ["struct alignas(16) Rows {"] + ["  __device__ " + l for l in function("device_member", 81)] + ["};"])

write("file_501.py", ["# filler"] * 501)
write("file_500.py", ["# filler"] * 500)
write("file_501_reason.py", ["# Long file: a stated reason"] + ["# filler"] * 500)
write("fn_61.py", py_function("too_long", 61))
write("fn_60.py", py_function("just_right", 60))
write("fn_61_reason.py", py_function("explained", 61, head=["# Long: a stated reason", "@decorator"]))
write("method_61.py", ["class Holder:", "    x = 1"] + py_function("method", 61, indent="    ", keyword="async def"))

run = subprocess.run([sys.executable, script, tree], capture_output=True, text=True)
out = run.stdout + run.stderr
print(out)
expected = [
    "file_601.cc:1: 601 lines, more than 600",
    "fn_81.cc:1: too_long has 81 lines, more than 80",
    "member_81.cc:3: member has 81 lines, more than 80",
    "file_601.cu:1: 601 lines, more than 600",
    "kernel_81.cu:1: too_long_kernel has 81 lines, more than 80",
    "struct_81.cuh:2: device_member has 81 lines, more than 80",
    "file_501.py:1: 501 lines, more than 500",
    "fn_61.py:1: too_long has 61 lines, more than 60",
    "method_61.py:3: method has 61 lines, more than 60",
]
problems = [f"missing: {e}" for e in expected if e not in out]
if run.returncode != 1:
    problems.append(f"exit status {run.returncode}, expected 1")
if len([l for l in out.splitlines() if l.strip()]) != len(expected):
    problems.append(f"expected exactly {len(expected)} violations")
if problems:
    sys.exit("\n".join(problems))
print("check_sizes.py catches every violation and only those")
