"""Every check one folder must pass, in one command, with each check's result, time and tier.

    python tools/review/check_variant.py variants/my_idea          # both tiers (a few minutes on 2 cores)
    python tools/review/check_variant.py variants/my_idea --fast   # the fast tier's checks only
    python tools/review/check_variant.py variants/a variants/b     # several folders

What runs, for each folder (from the repository root, in the README's test venv):
- pytest with `--folder <folder>` (conftest.py): every test that has the folder as a parameter (the contract
  in tests/contract/test_contract.py with decoding and the row split over context 2 and 4, the train loop in
  tests/contract/test_loop.py, the optimizers' loss test, Hugging Face in tests/fast/test_hf.py where the folder has an
  hf.py, lm-eval's batch check, the docs rules of a folder in tests/fast/test_docs.py) and the folder's own tests
  (variants/<name>/test_<name>.py). Selected by folder, not by a -k string, so a test id's suffix
  (`-2]`, `-default]`) cannot leave a check out;
- the lineage: `tools/review/variant_diff.py <folder> --strict` (the declared parent exists and is the nearest
  sibling in code);
- the linter and the formatter: `ruff check <folder>`, `ruff format --check <folder>` (pyproject.toml).
Then one line per check (a test function counts once, however many cases it has): its result, its
seconds (setup and teardown included; under pytest's two workers), and its tier (`fast`: a plain
`python -m pytest -q` runs it; `integration`: `-m integration` does; docs/testing.md). The exit status is 0
when everything passed, 1 when a check failed, 2 on a usage error. A test that skips is listed with the
reason (an extra not installed names the install that brings it in).
"""

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST_BUDGET_S = 30  # what a folder's long check (FAST_TIER in its train.py) may take in the fast tier, on 2 cores


class Recorder:
    """A pytest plugin: each test's outcome, seconds and tier, as the controller (or the only process) sees them."""

    def __init__(self):
        self.tests = {}  # nodeid -> [outcome, seconds, tier, skip reason]

    def pytest_runtest_logreport(self, report):
        t = self.tests.setdefault(report.nodeid, ["passed", 0.0, "fast", ""])
        t[1] += report.duration
        if "integration" in report.keywords:
            t[2] = "integration"
        if report.failed:
            t[0] = "failed"
        elif report.skipped and t[0] != "failed":
            t[0] = "skipped"
            longrepr = report.longrepr
            t[3] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def strip_group(nodeid: str) -> str:
    """The node id without the `@group` pytest-xdist's --dist loadgroup appends."""
    return nodeid.split("@")[0] if "]@" in nodeid or "@" in nodeid.rsplit("::", 1)[-1] else nodeid


def check_name(nodeid: str) -> str:
    """tests/contract/test_contract.py::test_step[variants/kda] -> test_contract.py::test_step."""
    path, _, rest = strip_group(nodeid).partition("::")
    return f"{os.path.basename(path)}::{rest.split('[')[0]}"


def summarize(tests: dict) -> list[tuple[str, str, float, str, str]]:
    """One row per test function: (name, result, seconds, tier, note)."""
    rows = collections.OrderedDict()
    for nodeid, (outcome, seconds, tier, reason) in sorted(tests.items()):
        r = rows.setdefault(
            check_name(nodeid), {"n": 0, "outcomes": collections.Counter(), "s": 0.0, "tiers": set(), "reasons": []}
        )
        r["n"] += 1
        r["outcomes"][outcome] += 1
        r["s"] += seconds
        r["tiers"].add(tier)
        if reason and reason not in r["reasons"]:
            r["reasons"].append(reason)
    out = []
    for name, r in rows.items():
        o = r["outcomes"]
        result = "FAILED" if o["failed"] else "skipped" if o["skipped"] == r["n"] else "passed"
        counts = ", ".join(f"{n} {k}" for k, n in o.items()) if r["n"] > 1 else ""
        note = "; ".join(filter(None, [counts, *r["reasons"]]))
        out.append((name, result, r["s"], "+".join(sorted(r["tiers"])), note))
    return out


def run_tool(cmd: list[str]) -> tuple[str, float, str]:
    start = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return ("passed" if p.returncode == 0 else "FAILED"), time.monotonic() - start, (p.stdout + p.stderr).strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python tools/review/check_variant.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folders", nargs="+", metavar="FOLDER", help="variants/<name> or templates/base")
    p.add_argument("--fast", action="store_true", help="the fast tier's checks only (skip the integration tier's)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2, as the suites run)")
    args = p.parse_args(argv)
    folders = [os.path.relpath(os.path.abspath(f), ROOT).replace(os.sep, "/") for f in args.folders]
    for f in folders:
        if not (
            os.path.isfile(os.path.join(ROOT, f, "model.py")) and os.path.isfile(os.path.join(ROOT, f, "train.py"))
        ):
            p.error(f"{f}: not a folder with model.py and train.py (variants/<name> or templates/base)")
    try:
        import pytest
    except ImportError:
        p.error("pytest is not installed: pip install -e '.[test,hf]' (README, 'Set up and run')")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.chdir(ROOT)
    rec = Recorder()
    marker = "not integration" if args.fast else ""
    pytest_args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=0",
        "--durations-min=1000",
        "-m",
        marker,
        "-n",
        str(args.workers),
        "-o",
        "console_output_style=classic",
    ]
    for f in folders:
        pytest_args += ["--folder", f]
    start, load = time.monotonic(), os.getloadavg()[0]
    code = pytest.main(pytest_args, plugins=[rec])
    if code not in (0, 1):  # 5: nothing collected; 2-4: interrupted, internal or usage error
        print(f"pytest stopped with exit status {code} before the checks finished", file=sys.stderr)
        return 1
    rows = summarize(rec.tests)
    tool_rows = []
    for f in folders:
        result, s, out = run_tool([sys.executable, "tools/review/variant_diff.py", f, "--strict"])
        tool_rows.append(
            (
                f"lineage: tools/review/variant_diff.py {f} --strict",
                result,
                s,
                "fast",
                "" if result == "passed" else out.splitlines()[-1],
            )
        )
        ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
        for command in (["check"], ["format", "--check"]):
            what = f"lint: ruff {' '.join(command)} {f}"
            if os.path.exists(ruff):
                result, s, out = run_tool([ruff, *command, f])
                tool_rows.append((what, result, s, "fast", "" if result == "passed" else out))
            else:
                tool_rows.append((what, "skipped", 0.0, "fast", "ruff not installed: pip install -e '.[test]'"))
    notes = []
    for f in folders:
        name = os.path.basename(f)
        readme, hf_doc = (open(os.path.join(ROOT, d)).read() for d in ("README.md", "docs/huggingface.md"))
        missing = [
            d
            for d, ok in (
                ("README.md's tour", f"`{f}/`" in readme),
                ("docs/huggingface.md's table", f"| `{name}` |" in hf_doc),
            )
            if not ok
        ]
        if f.startswith("variants/") and missing:
            notes.append(
                f"{f} is not in {' or '.join(missing)}: add its rows when you propose it for main "
                f"(skills/new-variant, step 9); a copy on a branch needs none"
            )
    long_checks = {
        "test_loop.py::test_the_loop_uses_the_run": "loop",
        "test_contract.py::test_context_parallel_is_exact": "context",
    }
    for nodeid, (_, seconds, tier, _) in rec.tests.items():
        name = long_checks.get(check_name(nodeid))
        if name and tier == "fast" and seconds > FAST_BUDGET_S:
            busy = max(load, os.getloadavg()[0]) > (os.cpu_count() or 1)
            notes.append(
                f"{strip_group(nodeid)} took {seconds:.0f} s in the fast tier, over the {FAST_BUDGET_S} s a folder's long "
                + (
                    f"check may take there, but on a busy machine (load average above {os.cpu_count()}): measure again "
                    f'on a quiet one before you drop "{name}" from FAST_TIER in its train.py (docs/testing.md)'
                    if busy
                    else f'check may take there: drop "{name}" from FAST_TIER in its train.py (docs/testing.md)'
                )
            )
    print(
        f"\nchecks of {', '.join(folders)} ({'the fast tier' if args.fast else 'both tiers'}; "
        f"{time.monotonic() - start:.0f} s in all, pytest on {args.workers} workers; load average "
        f"{load:.1f} at the start on {os.cpu_count()} cores: times on a busier machine run longer):\n"
    )
    width = max(len(r[0]) for r in rows + tool_rows)
    for name, result, s, tier, note in rows + tool_rows:
        print(f"  {name:<{width}}  {result:<7} {s:7.1f} s  {tier:<11} {note}".rstrip())
    totals = collections.defaultdict(float)
    for _, _, s, tier, _ in rows + tool_rows:
        totals[tier] += s
    print("\n  seconds by tier: " + ", ".join(f"{t} {s:.0f}" for t, s in sorted(totals.items())))
    for n in notes:
        print(f"\n  note: {n}")
    failed = [r[0] for r in rows + tool_rows if r[1] == "FAILED"]
    print(f"\n{len(failed)} check(s) failed: " + ", ".join(failed) if failed else "\nevery check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
