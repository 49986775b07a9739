import os

import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter (set before any import of triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# pytest-xdist workers share the machine's cores: each takes its share of torch's CPU threads
# (by default every process takes them all, and their waiting OpenMP threads contend: tests/ops
# and tests/kernels with two workers on two cores, 260 s with two threads each, 241 with one).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture(autouse=True)
def _seed_and_precision():
    torch.manual_seed(0)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.fixture(autouse=True)
def _fp8_routes_under_test(request):
    """Small FP8 calls on CUDA take the ``fp8_fused`` route by default, and the tests' problems
    are small: tests written for the other FP8 routes keep them (the threshold at 0); the
    ``fp8_fused`` route's own tests, marked so, get the default rule."""
    if request.node.get_closest_marker("fp8_fused"):
        yield
        return
    from grouped_linear import _tuning

    with _tuning.override(fp8_fused_max_work=0):
        yield


# --------------------------------------------------------------------------- bad-input report
# How many inputs the bad-input suite tried, by class, printed at the end of a run; under
# pytest-xdist each worker hands its counts to the controller, which prints the sum.
def _tried():
    from tests.bad_input.checks import TRIED

    return TRIED


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["bad_input_tried"] = dict(_tried())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _tried().update(getattr(node, "workeroutput", {}).get("bad_input_tried", {}))


def pytest_terminal_summary(terminalreporter):
    tried = _tried()
    if tried:
        classes = ", ".join(f"{kind} {count}" for kind, count in sorted(tried.items()))
        terminalreporter.write_line(f"bad-input suite: {sum(tried.values())} inputs tried "
                                    f"({classes})")
