"""The integration tier of tests/fast/test_optim.py: the optimizers sharded against one device and the
hyperball's norms, 20-75 s a case. What they share with the fast half is imported from it."""

import jax
import numpy as np
import pytest
from shared import optim
from shared.weights import init_params
from fast.test_optim import _one_device_mesh, decl, mesh_of, run  # noqa: F401  (tests/fast/test_optim.py; its autouse mesh)


# 20-150 s each on 2 cores: the integration tier (the fast tier's test_optim cases check each optimizer's
# update rule and sharding specs on their own)
@pytest.mark.integration  # every case 20-75 s: each optimizer sharded against one device
@pytest.mark.parametrize(
    "name,expert",
    [pytest.param(n, True) for n in optim.OPTIMIZERS] + [pytest.param("muon", False), pytest.param("adamh", False)],
)
def test_sharded_equals_one_device(name, expert):
    """Three steps on data x expert x model = 2x2x2 (with experts: every optimizer) and on data x model =
    4x2 (dense: Newton-Schulz and the Adam hyperball) equal the same steps on one device, to fp32
    tolerance; the optimizer state keeps the weights' specs."""
    mesh = mesh_of((2, 2, 2), ("data", "expert", "model")) if expert else mesh_of((4, 2), ("data", "model"))
    d = decl(expert)
    one, _ = run(d, name, 3)
    many, state = run(d, name, 3, mesh)
    for a, b in zip(one, many):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6), a, b)
    specs = optim.state_specs(d, name)
    got = jax.tree.map(lambda x: x.sharding.spec, state)
    assert jax.tree.structure(got) == jax.tree.structure(specs)
    for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(specs)):
        assert tuple(g) + (None,) * (len(s) - len(g)) == tuple(s) + (None,) * (len(g) - len(s)), (name, g, s)


@pytest.mark.integration  # 20-75 s each
@pytest.mark.parametrize("name", ["muonh", "adamh"])
def test_hyperball_keeps_every_matrix_norm(name):
    d = decl(expert=True)
    init = jax.tree.map(np.asarray, init_params(d, jax.random.key(0), "float32"))
    before = None
    for params in run(d, name, 4)[0]:
        for key in ("w_in", "w_out", "ex_up"):
            w = d["layers"][key]
            axes = (w.fan_in, w.fan_out)
            r0 = np.linalg.norm(init["layers"][key], axis=axes)
            np.testing.assert_allclose(np.linalg.norm(params["layers"][key], axis=axes), r0, rtol=1e-5)
        if before is not None:  # and they move
            assert not np.allclose(params["layers"]["w_in"], before)
        before = params["layers"]["w_in"]
