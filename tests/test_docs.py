"""The commands the docs send people to answer `--help`: every tool, launcher, `python -m shared...`
command and variant script with a `__main__` (each folder's train.py is checked in-process by the
contract's test_help_lists_every_field)."""

import glob
import os
import subprocess
import sys

from shared.variant import ROOT


def commands() -> list[list[str]]:
    """argv (after the interpreter) of every runnable file: `-m shared.x` for a module of shared/, the
    path for a script. A file runs as a command when it has a `__main__` block."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        if rel.startswith(("tests", ".venv", "build")) or rel.endswith("/train.py"):
            continue
        with open(path) as f:
            if 'if __name__ == "__main__"' not in f.read():
                continue
        out.append(["-m", rel[:-3].replace(os.sep, ".")] if rel.startswith("shared") else [rel])
    return out


def test_every_command_answers_help():
    """All at once (each is its own process), so the whole check costs about the slowest import."""
    cmds = commands()
    assert any("tools/variant_diff.py" in c for c in cmds) and any("shared.pretokenize" in c for c in cmds), cmds
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = [(c, subprocess.Popen([sys.executable, *c, "--help"], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)) for c in cmds]
    failed = []
    for c, p in procs:
        out, err = p.communicate(timeout=300)
        if p.returncode != 0 or "usage" not in (out + err).lower() or "Traceback" in err:
            failed.append(f"{' '.join(c)} --help: exit {p.returncode}\n{(out + err)[-600:]}")
    assert not failed, "\n\n".join(failed)
