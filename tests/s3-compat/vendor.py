"""Copies the subset of ceph/s3-tests that runs here out of a checkout of it.

    python vendor.py S3_TESTS_CHECKOUT

s3tests/functional/test_s3.py is cut down to the tests named in tests.txt and what they
use (helpers, classes, module-level names), each kept as its source text; the modules it
imports are copied as they are. Run it again from a newer checkout to update the copy.
"""

import ast
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
COPIED = ["__init__.py", "utils.py", "policy.py", "iam.py"]


def names_used(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def names_bound(stmt):
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def cut(source, wanted):
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    tests = {
        s.name
        for s in tree.body
        if isinstance(s, ast.FunctionDef) and s.name.startswith("test_")
    }
    missing = wanted - tests
    if missing:
        sys.exit(f"not in test_s3.py: {', '.join(sorted(missing))}")
    # What the wanted tests reach, through helpers and module-level names.
    keep = set(wanted)
    frontier = [s for s in tree.body if names_bound(s) & keep]
    while frontier:
        used = set().union(*(names_used(s) for s in frontier))
        frontier = [s for s in tree.body if (names_bound(s) & used) - keep]
        for s in frontier:
            keep |= names_bound(s)
    out = []
    for s in tree.body:
        imports = isinstance(s, (ast.Import, ast.ImportFrom))
        if imports or names_bound(s) & keep:
            first = min([s.lineno] + [d.lineno for d in getattr(s, "decorator_list", [])])
            out.append("".join(lines[first - 1 : s.end_lineno]).rstrip() + "\n")
    return "\n\n".join(out)


def main(checkout):
    upstream = pathlib.Path(checkout) / "s3tests"
    wanted = {
        line.strip()
        for line in (HERE / "tests.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    dest = HERE / "s3tests" / "functional"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(upstream / "__init__.py", HERE / "s3tests" / "__init__.py")
    for name in COPIED:
        shutil.copy(upstream / "functional" / name, dest / name)
    source = (upstream / "functional" / "test_s3.py").read_text()
    header = (
        "# ceph/s3-tests s3tests/functional/test_s3.py, cut down by vendor.py to the\n"
        "# tests named in tests.txt and what they use; the code is upstream's, unchanged.\n\n"
    )
    (dest / "test_s3.py").write_text(header + cut(source, wanted))
    for name in ["LICENSE", "pytest.ini"]:
        shutil.copy(pathlib.Path(checkout) / name, HERE / name)


if __name__ == "__main__":
    main(sys.argv[1])
