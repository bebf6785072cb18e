"""The shared layer's structure stays readable (tools/review/import_graph.py measures it): no import circle, a
bounded depth, and a run harness that holds the run's plumbing only: it imports no evaluation, decoding,
command or variant-loading module, so `shared/run.py` can be read without them."""

import os

from shared.variant import ROOT, load

graph_tool = load(os.path.join(ROOT, "tools", "review", "import_graph.py"))

MAX_DEPTH = 8  # modules in the longest chain of imports (10 with a circle before the redesign)
MAX_LAYERS = 5  # the same with each subpackage one node: errors <- storage <- data <- run <- cli (7 before)
RUN_IMPORTS = 9  # shared modules shared/run.py imports (13 before), from 7 subpackages and top modules


def test_shared_has_no_import_circle_and_a_bounded_depth():
    g = graph_tool.graph("shared")
    assert graph_tool.cycles(g) == []
    chain = graph_tool.longest_chain(g)
    assert len(chain) <= MAX_DEPTH, " -> ".join(chain)


def test_the_subpackages_are_layers_at_most_five_deep():
    """shared/storage, data, runtime, kernels, evals, modelio as nodes: no circle between them, and at most five
    layers from errors to a command (the commands at the top: cli, generate, lm_eval_model, probes)."""
    g = graph_tool.packages(graph_tool.graph("shared"))
    assert graph_tool.cycles(g) == [], graph_tool.cycles(g)
    chain = graph_tool.longest_chain(g)
    assert len(chain) <= MAX_LAYERS, " -> ".join(chain)


def test_the_run_harness_imports_no_evaluation_decoding_command_or_variant():
    g = graph_tool.graph("shared")
    own = g["shared.run"]
    assert len(own) <= RUN_IMPORTS, sorted(own)
    banned = {m for m in g if m.startswith("shared.evals")} | {
        "shared.decode",
        "shared.generate",
        "shared.probes",
        "shared.lm_eval_model",
        "shared.modelio.trained",
        "shared.variant",
    }
    assert not own & banned, sorted(own & banned)


def test_a_tests_folder_says_its_tier():
    """tests/fast/ holds no integration test (conftest.py refuses one at collection; here the files themselves
    name no such mark), and tests/integration/ is marked whole by its folder: a reader sees a test's tier from
    its path (docs/testing.md)."""
    import glob
    import re

    marked = [
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "tests", "fast", "*.py"))
        if os.path.abspath(p) != os.path.abspath(__file__)  # this file names the marks it looks for
        and re.search(r"mark\.integration|pytestmark", open(p).read())
    ]
    assert not marked, f"integration marks in tests/fast/ (move those tests to tests/integration/): {marked}"
    assert {os.path.basename(os.path.dirname(d)) for d in glob.glob(os.path.join(ROOT, "tests", "*", ""))} >= {
        "fast",
        "integration",
        "contract",
    }
