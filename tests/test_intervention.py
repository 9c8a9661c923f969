import jax.numpy as jnp
import numpy as np
import pytest

from fthsdp.step.intervention import Intervention, lr_scale


@pytest.mark.parametrize("xp", [np, jnp])
def test_scales(xp):
    assert float(lr_scale(Intervention.NONE, 1, 4, xp=xp)) == 1.0
    assert float(lr_scale(Intervention.LINEAR, 1, 4, xp=xp)) == 0.25
    assert float(lr_scale(Intervention.SQRT, 1, 4, xp=xp)) == 0.5
    assert float(lr_scale(Intervention.SQRT, 4, 4, xp=xp)) == 1.0
    assert float(lr_scale(Intervention.LINEAR, 0, 0, xp=xp)) == 0.0  # degenerate: no healthy replica
    assert float(lr_scale(Intervention.SQRT, 9, 4, xp=xp)) == 1.0  # clipped


def test_parse():
    assert Intervention.parse("SQRT") is Intervention.SQRT
    assert Intervention.parse(1) is Intervention.LINEAR
    with pytest.raises(ValueError, match="choose one of: none, linear, sqrt"):
        Intervention.parse("cubic")
