"""The integration tier of tests/fast/test_doc_commands.py (Every documented training command runs: each `python
<folder>/train.py ...` line of a fenced code block in README.md, docs/ and the folders' READMEs, exactly as
written with flags appended for size only (SIZE: two steps of 8 rows of 32 tokens, a few evaluation rows,
small probes, a 4-token sample; a preset's model shrunk to a tiny one) and `--run_dir` in the test's
directory, in the order the doc gives them, so that a documented command cannot crash (the default end-of-run
sample included). `/tmp/` paths move under the test's directory, and the `python -m shared.probes write` lines
of a doc run first (the data its commands train on). The README's first command (the built-in default) runs as
a user runs it on a fresh machine: its own process on one CPU device; its `--resume true` continues that run
here, on 8 devices): the checks that start real processes or servers, or run long. What they share with the
fast half is imported from it."""

import os
import subprocess
import sys
import pytest
from shared import cli
from shared import probes
from shared.variant import ROOT, load
from helpers import sub_env
from fast.test_doc_commands import (
    DOCS,
    NOT_RUN,
    PRESET_MODEL,
    PROBE_WRITE_SIZE,
    SIZE,
    lines,
    trains,
)  # (tests/fast/test_doc_commands.py)


def model_size(script: str) -> list[str]:
    """The folder's CONTRACT_TINY model fields as flags (a window shorter than 32 tokens, kda's chunks)."""
    own = load(os.path.join(ROOT, script)).CONTRACT_TINY.get("model", {})
    return [x for k, v in own.items() for x in (f"--model.{k}", str(v))]


@pytest.mark.integration  # about twenty short runs of every folder's train.py
@pytest.mark.parametrize("doc", [d for d in DOCS if any(trains(a) and " ".join(a) not in NOT_RUN for a in lines(d))])
def test_every_documented_training_command_runs(doc, tmp_path):
    tmp = str(tmp_path)
    ran, first_dirs = [], {}  # the commands run; the bare command's run directory, by script
    for argv in lines(doc):
        argv = [a.replace("/tmp/", tmp + "/") for a in argv]
        if argv[:3] == ["-m", "shared.probes", "write"]:
            assert probes.main(argv[2:] + PROBE_WRITE_SIZE) == 0, argv
            continue
        if not trains(argv):
            continue
        shown = " ".join(a.replace(tmp + "/", "/tmp/") for a in argv)
        if shown in NOT_RUN:
            continue
        script, flags = argv[0], argv[1:]
        size = SIZE + model_size(script) + (PRESET_MODEL if "--preset" in flags else [])
        if flags == ["--resume", "true"]:  # continues the run of the bare command before it, one step further
            run_dir = first_dirs[script]
            size = [*size, "--steps", "3"]
        else:
            run_dir = os.path.join(tmp, f"run{len(ran)}")
        full = flags + size + ["--run_dir", run_dir]
        if not flags and script not in first_dirs:  # the bare command: as a user runs it, one device
            first_dirs[script] = run_dir
            r = subprocess.run(
                [sys.executable, script, *full],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
                env=sub_env(XLA_FLAGS="", STENCIL_CACHE=os.environ["STENCIL_CACHE"]),
            )
            assert r.returncode == 0, (shown, r.stderr[-3000:])
            assert "--- sample after 2 steps ---" in r.stdout, (shown, r.stdout[-2000:])
        else:
            train = load(os.path.join(ROOT, script))
            out = train.main(cli.parse(train.TrainConfig, os.path.dirname(os.path.join(ROOT, script)), full))
            assert out["step"] >= 2 and out["losses"], shown
        ran.append(shown)
