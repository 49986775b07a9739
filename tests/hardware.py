"""What the machine running the tests can do, for tests of hardware-specific kernels."""

import pytest
import torch

from grouped_linear.kernels._gluon import HAS_GLUON

#: An sm90 (Hopper) GPU with Triton's Gluon: where the Gluon kernels can run.
HOPPER_GLUON = (HAS_GLUON and torch.cuda.is_available()
                and torch.cuda.get_device_capability() == (9, 0))

#: Skips a test of a Gluon kernel elsewhere (CI compiles them for sm90 instead).
sm90 = pytest.mark.skipif(not HOPPER_GLUON, reason="needs an sm90 GPU and Gluon")
