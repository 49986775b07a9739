"""``make test-gpu`` runs every test file that touches CUDA: none may be left out."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gpu_test_paths() -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    block = makefile[makefile.index("GPU_TEST_PATHS :="):makefile.index("GPU_TEST_WORKERS ?=")]
    return block.replace("GPU_TEST_PATHS :=", "").replace("\\", " ").split()


def _covered(path: str, paths: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths)


def test_every_cuda_test_file_is_in_test_gpu():
    """Each file of tests/gpu, every kernel and op test, and any other test file that picks
    CUDA where it is available lies under one of ``GPU_TEST_PATHS``."""
    paths = _gpu_test_paths()
    assert paths and all((ROOT / p).exists() for p in paths), paths
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py"))
    cuda = [f for f in files
            if f.startswith(("tests/gpu/", "tests/kernels/", "tests/ops/"))
            or re.search(r"torch\.cuda\.is_available\(\)", (ROOT / f).read_text())]
    assert any(f.startswith("tests/gpu/") for f in cuda), "no CUDA test files found"
    missing = [f for f in cuda if not _covered(f, paths)]
    assert not missing, f"add to GPU_TEST_PATHS in the Makefile: {missing}"
