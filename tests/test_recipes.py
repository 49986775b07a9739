"""Recipes: validation, gl.autocast regions and their precedence."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Rowwise, Float8Tensorwise, current_recipe


def test_recipes_are_frozen_and_validated():
    r = Float8Rowwise()
    assert r.forward_dtype == torch.float8_e4m3fn and r.gradient_dtype == torch.float8_e4m3fn
    assert Float8Tensorwise(fp8_format="hybrid").gradient_dtype == torch.float8_e5m2
    with pytest.raises(AttributeError):
        r.fp8_format = "hybrid"
    with pytest.raises(ValueError, match=r"fp8_format='e5m2' is not one of"):
        Float8Rowwise(fp8_format="e5m2")
    with pytest.raises(TypeError, match=r"power_of_two_scales must be a bool, got 1"):
        Float8Rowwise(power_of_two_scales=1)
    assert Float8Rowwise() == Float8Rowwise() and hash(Float8Rowwise()) == hash(Float8Rowwise())


def test_autocast_nests_and_restores():
    assert current_recipe() is None
    with gl.autocast(Float8Rowwise()):
        assert current_recipe() == Float8Rowwise()
        with gl.autocast(None):
            assert current_recipe() is None
        with gl.autocast(Float8Tensorwise()):
            assert current_recipe() == Float8Tensorwise()
        assert current_recipe() == Float8Rowwise()
    assert current_recipe() is None
    with pytest.raises(TypeError, match=r"recipe='fp8' is not a known recipe"):
        with gl.autocast("fp8"):
            pass


def test_module_recipe_wins_over_autocast():
    torch.manual_seed(0)
    x = torch.randn(12, 32)
    plain = gl.GroupedLinear(2, 32, 16)
    rowwise = gl.GroupedLinear(2, 32, 16, recipe=Float8Rowwise())
    rowwise.load_state_dict(plain.state_dict())
    with gl.autocast(Float8Tensorwise()):
        y_auto = plain(x, [5, 7])
        y_own = rowwise(x, [5, 7])
    y_tensorwise = gl.GroupedLinear(2, 32, 16, recipe=Float8Tensorwise())
    y_tensorwise.load_state_dict(plain.state_dict())
    assert torch.equal(y_auto, y_tensorwise(x, [5, 7]))
    assert torch.equal(y_own, rowwise(x, [5, 7]))
    assert not torch.equal(y_own, y_auto) and not torch.equal(y_auto, plain(x, [5, 7]))


def test_fp8_recipe_needs_fp8_matrix_units(monkeypatch):
    from grouped_linear.recipes import check_recipe

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"needs FP8 matrix units \(sm89 or newer\); device "
                                         r"cuda:0 is sm80"):
        check_recipe(Float8Rowwise(), torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert check_recipe(Float8Rowwise(), torch.device("cuda:0")) == Float8Rowwise()
