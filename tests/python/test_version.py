"""moe_ep.__version__ is the C++ library's version, which is the project version of the
top-level CMakeLists.txt (read here from the file itself)."""

import pathlib
import re

import moe_ep


def test_version_is_the_project_version():
    text = (pathlib.Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    m = re.search(r"project\(moe_ep VERSION (\d+\.\d+\.\d+)", text)
    assert m, "no project version in CMakeLists.txt"
    assert moe_ep.__version__ == m.group(1)
    assert moe_ep._C.__version__ == m.group(1)
