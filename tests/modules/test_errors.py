"""Every bad input gets a ValueError/TypeError that names the argument and the value."""

import pytest
import torch

import grouped_linear as gl

G, K, N = 3, 8, 4


@pytest.mark.parametrize(
    "args, kwargs, error, pattern",
    [
        ((0, K, N), {}, ValueError, r"num_gemms is 0: must be >= 1"),
        ((G, -2, N), {}, ValueError, r"in_features is -2: must be >= 1"),
        ((G, K, 0), {}, ValueError, r"out_features is 0: must be >= 1"),
        ((2.5, K, N), {}, TypeError, r"num_gemms is 2.5 of type float: expected an int"),
        ((G, K, N), {"backend": "cublas"}, ValueError, r"backend='cublas'"),
        ((G, K, N), {"recipe": "fp8"}, TypeError, r"recipe='fp8'"),
        ((G, K, N), {"parallel_mode": "diagonal"}, ValueError, r"parallel_mode='diagonal' is not"),
        ((G, K, N), {"tp_size": 2}, ValueError, r"tp_size=2 needs parallel_mode"),
        ((G, K, N), {"parallel_mode": "row", "tp_size": 2}, ValueError,
         r"tp_size=2 with tp_group=None needs an initialised torch.distributed"),
        ((G, K, N), {"parallel_mode": "row", "reduce_output": False}, ValueError,
         r"reduce_output=False .* use return_bias=True"),
        ((G, K, N), {"init_method": 3}, TypeError, r"init_method must be callable, got 3"),
        ((G, K, N), {"params_dtype": torch.int32}, TypeError,
         r"params_dtype=torch.int32: expected a floating-point"),
        ((G, K, N), {"params_dtype": torch.float8_e4m3fn}, TypeError,
         r"params_dtype=torch.float8_e4m3fn: .* float32 .* gl.to_fp8_weights\(model\)"),
        ((G, K, N), {"return_bias": "y"}, TypeError, r"return_bias must be a bool, got 'y'"),
    ],
)
def test_constructor_errors(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        gl.GroupedLinear(*args, **kwargs)


@pytest.fixture
def layer():
    return gl.GroupedLinear(G, K, N)


@pytest.mark.parametrize(
    "x_shape, m_splits, error, pattern",
    [
        ((6, K), [2, 4], ValueError, r"m_splits has length 2 but num_gemms is 3"),
        ((6, K), torch.tensor([2, 4]), ValueError, r"m_splits has length 2 but num_gemms is 3"),
        ((6, K), [2, -1, 5], ValueError, r"m_splits\[1\] is -1"),
        ((6, K), torch.tensor([2, -1, 5]), ValueError, r"m_splits\[1\] is -1"),
        ((6, K), [2, 2, 3], ValueError, r"m_splits sums to 7 but the input has 6 rows"),
        ((6, K), torch.tensor([1, 1, 1]), ValueError, r"m_splits sums to 3 but the input has 6"),
        ((6, K), [2, 2.0, 2], TypeError, r"m_splits\[1\] is 2.0 of type float"),
        ((6, K), [2, True, 3], TypeError, r"m_splits\[1\] is True"),
        ((6, K), torch.tensor([2.0, 2.0, 2.0]), TypeError, r"m_splits has dtype torch.float32"),
        ((6, K), torch.tensor([[2, 2, 2]]), ValueError, r"m_splits has shape \(1, 3\)"),
        ((6, K), "2,2,2", TypeError, r"m_splits is str"),
        ((6, K), None, ValueError, r"m_splits is required"),
        ((6, K + 1), [2, 2, 2], ValueError, r"x has 9 features \(shape \(6, 9\)\), expected 8"),
        ((6, K, 1), [2, 2, 2], ValueError, r"x has 1 features \(shape \(6, 8, 1\)\), expected 8"),
        ((), [2, 2, 2], ValueError, r"x has shape \(\): expected \(\.\.\., 8\)"),
        ((6 * K,), [2, 2, 2], ValueError, r"x has shape \(48,\): expected \(\.\.\., 8\)"),
    ],
)
def test_forward_errors(layer, x_shape, m_splits, error, pattern):
    with pytest.raises(error, match=pattern):
        layer(torch.randn(x_shape), m_splits)


def test_dtype_and_device_mismatch(layer):
    with pytest.raises(TypeError, match=r"weight has dtype torch.float32 but x has dtype "
                                        r"torch.float64"):
        layer(torch.randn(6, K, dtype=torch.float64), [2, 2, 2])
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor or a list of tensors, got ndarray"):
        import numpy as np

        layer(np.zeros((6, K)), [2, 2, 2])
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        gl.GroupedLinear(G, K, N, device="meta")(torch.randn(6, K), [2, 2, 2])


def test_list_input_errors(layer):
    with pytest.raises(ValueError, match=r"x\[1\] has shape \(2, 5\), expected \(rows, 8\)"):
        layer([torch.randn(2, K), torch.randn(2, 5), torch.randn(1, K)])
    with pytest.raises(TypeError, match=r"x\[2\] is torch.float64 on cpu but x\[0\] is "
                                        r"torch.float32"):
        layer([torch.randn(2, K), torch.randn(2, K), torch.randn(1, K, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"m_splits=\[1, 2, 2\] disagrees .* \[2, 2, 1\]"):
        layer([torch.randn(2, K), torch.randn(2, K), torch.randn(1, K)], [1, 2, 2])
    with pytest.raises(ValueError, match=r"x is a list of 2 tensors, expected one per group "
                                         r"\(3 groups\)"):
        layer([torch.randn(2, K), torch.randn(2, K)])


def test_triton_backend_needs_a_device_for_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = gl.GroupedLinear(G, K, N, backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton' needs triton and a CUDA device"):
        layer(torch.randn(6, K), [2, 2, 2])
    with pytest.raises(ValueError, match=r"backend='triton' does not support dtype torch.float64"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        gl.grouped_linear(torch.randn(6, K).double(), torch.randn(G, N, K).double(), None,
                          [2, 2, 2], backend="triton")


def test_functional_errors():
    x, w = torch.randn(6, K), torch.randn(G, N, K)
    with pytest.raises(ValueError, match=r"weight has shape \(4, 8\): expected \(G, out, in\)"):
        gl.grouped_linear(x, w[0], None, [2, 2, 2])
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(3, 4\)"):
        gl.grouped_linear(x, w, torch.randn(G), [2, 2, 2])
    with pytest.raises(ValueError, match=r"backend='fast'"):
        gl.grouped_linear(x, w, None, [2, 2, 2], backend="fast")
    with pytest.raises(TypeError, match=r"recipe='fp8'"):
        gl.grouped_linear(x, w, None, [2, 2, 2], recipe="fp8")
    with pytest.raises(ValueError, match=r"backend='grouped' does not support dtype torch.float64"):
        gl.grouped_linear(x.double(), w.double(), None, [2, 2, 2], backend="grouped")
    with pytest.raises(TypeError, match=r"x has dtype torch.int64"):
        gl.grouped_linear(x.long(), w.long(), None, [2, 2, 2])


def test_mlp_errors():
    with pytest.raises(ValueError, match=r"activation='tanh'"):
        gl.GroupedMLP(2, 8, 16, activation="tanh")
    with pytest.raises(ValueError, match=r"return_bias=True"):
        gl.GroupedMLP(2, 8, 16, return_bias=True)


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: gl.GroupedMLP(2, 4, 2.0), TypeError, r"ffn_hidden_size is 2.0 of type float"),
        (lambda: gl.GroupedMLP(0, 4, 8), ValueError, r"num_experts is 0: must be >= 1"),
        (lambda: gl.GroupedMLP(2, 4, 8, activation=["relu"]), ValueError,
         r"activation=\['relu'\] is not one of"),
        (lambda: gl.GroupedMLP(2, 4, 8, tp_size="2"), ValueError, r"tp_size='2' must be an int"),
        (lambda: gl.ExpertParallelMoE(4, 8, "4", 2), TypeError, r"num_experts is '4' of type str"),
        (lambda: gl.ExpertParallelMoE(4, 8, 0, 1), ValueError, r"num_experts is 0: must be >= 1"),
        (lambda: gl.ExpertParallelMoE(4, 8, 4, 1.5), TypeError, r"top_k is 1.5 of type float"),
        (lambda: gl.ExpertParallelMoE(4, 8, 4, True), TypeError, r"top_k is True of type bool"),
        (lambda: gl.ExpertParallelMoE(4, 8, 4, 2)(torch.randn(3, 5)), ValueError,
         r"x is \(3, 5\): expected a \(tokens, 4\) tensor"),
        (lambda: gl.GroupedLinear(G, K, N)(torch.randn(6, K), [2, 2, 2], return_bias="y"),
         TypeError, r"return_bias must be None or a bool, got 'y'"),
        (lambda: gl.GroupedLinear(G, K, N)(torch.ones(6, K, dtype=torch.long), [2, 2, 2]),
         TypeError, r"x has dtype torch.int64: expected a floating-point tensor"),
    ],
)
def test_argument_errors_name_the_argument(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


def test_state_dict_entry_that_is_not_a_tensor():
    state = gl.GroupedLinear(2, K, N, single_grouped_weight=False).state_dict()
    state["weight1"] = None
    with pytest.raises(TypeError, match=r"state dict entry 'weight1' is NoneType: expected a "
                                        r"tensor of shape \(4, 8\)"):
        gl.GroupedLinear(2, K, N).load_state_dict(state)


@pytest.mark.parametrize("flag", ["bias", "single_grouped_weight", "single_grouped_bias",
                                  "delay_wgrad_compute", "fuse_wgrad_accumulation"])
def test_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'no'"):
        gl.GroupedLinear(G, K, N, **{flag: "no"})


@pytest.mark.parametrize("value", [1, 0, torch.tensor(True)])
def test_is_first_microbatch_must_be_a_bool(value):
    layer = gl.GroupedLinear(G, K, N)
    with pytest.raises(TypeError, match="is_first_microbatch must be None or a bool"):
        layer(torch.randn(6, K), [2, 2, 2], is_first_microbatch=value)
