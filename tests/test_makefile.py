"""``make test-gpu`` lists its CUDA test files one by one: none may be left out."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cuda_test_file_is_in_a_test_gpu_group():
    makefile = (ROOT / "Makefile").read_text()
    groups = makefile[makefile.index("GPU_TEST_GROUPS :="):makefile.index("GPU_TEST_LOGS")]
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert files, "no CUDA test files found"
    missing = [f for f in files if f not in groups]
    assert not missing, f"add to GPU_TEST_GROUPS in the Makefile: {missing}"
    for folder in ("tests/kernels", "tests/ops"):
        assert folder in groups
